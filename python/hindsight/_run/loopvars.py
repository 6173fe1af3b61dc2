"""The state of a loop that lives in Python variables.

A checkpoint of ``hs.checkpointing``'s objects misses what a training loop
keeps in plain variables: an iteration counter driving the warm-up, the
batch prefetched for the next step, the last ``loss`` that code after the
loop reads, a running best. Seed 000's side-effect analysis finds them
statically: the names a loop body assigns (or changes through a method
call) that the enclosing scope reads. Their values are saved with every
checkpoint taken inside the loop and written back into the running frame
(module or function) when a checkpoint is restored, by resume or replay.

Values are kept when the store can hold them (numbers, strings, bytes,
tensors, arrays and containers of them), and so are objects the loop changes
through their methods whose state can be kept exactly (objstate.py: plain
Python objects, objects with a state_dict, numpy/torch/random generators),
restored in place. A variable the loop assigns
and later code reads that the store cannot hold is refused when the first
block ends, naming it, its line and the one-line fix: checkpoint it through
its ``state_dict``, or declare it ``transient`` (its value need not survive
a resume: a progress bar, an open file).
"""

from __future__ import annotations

import ast
import ctypes
import io
import linecache
import os
import sys
import types
from types import FrameType
from typing import Any

from hindsight._run import objstate
from hindsight.errors import ReplayError, UnsupportedTypeError

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_parsed: dict[tuple[str, float], ast.Module | None] = {}


def _mtime(filename: str) -> float | None:
    """The file's modification time; -1 for a Jupyter cell (no file: its
    source is in linecache, under a name made from its text); None when
    the source cannot be read (exec, a terminal session)."""
    try:
        return os.stat(filename).st_mtime
    except OSError:
        return -1.0 if _cell_source(filename) is not None else None


def _cell_source(filename: str) -> str | None:
    entry = linecache.cache.get(filename)
    # IPython's entries have no mtime (None): they are never checked against a file.
    if entry is None or len(entry) != 4 or entry[1] is not None:
        return None
    return "".join(entry[2])


def _tree(filename: str) -> ast.Module | None:
    mtime = _mtime(filename)
    if mtime is None:
        return None
    key = (filename, mtime)
    if key not in _parsed:
        try:
            if mtime == -1.0:
                _parsed[key] = ast.parse(_cell_source(filename) or "", filename=filename)
            else:
                with open(filename, "rb") as f:
                    _parsed[key] = ast.parse(f.read(), filename=filename)
        except (OSError, SyntaxError, ValueError):
            _parsed[key] = None
    return _parsed[key]


def _scope_of(tree: ast.Module, code: Any) -> ast.AST | None:
    """The module, or the function definition whose code object runs."""
    if code.co_name == "<module>":
        return tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if first <= code.co_firstlineno <= node.body[0].lineno:
                return node
    return None


def _own_nodes(node: ast.AST) -> list[ast.AST]:
    """Nodes in `node`'s own scope: not inside nested functions, classes or comprehensions."""
    out = []
    todo = list(ast.iter_child_nodes(node))
    while todo:
        n = todo.pop()
        out.append(n)
        if not isinstance(n, (*_SCOPES, *_COMPREHENSIONS)):
            todo.extend(ast.iter_child_nodes(n))
    return out


def _loop_at(scope: ast.AST, line: int) -> ast.For | ast.AsyncFor | None:
    """The innermost `for` of the scope whose header holds `line`."""
    best = None
    for n in _own_nodes(scope):
        if isinstance(n, (ast.For, ast.AsyncFor)) and n.lineno <= line <= (n.iter.end_lineno or n.lineno):
            if best is None or n.lineno >= best.lineno:
                best = n
    return best


def _target_base(n: ast.AST) -> str | None:
    """`x` of a store into `x.a`, `x[i]`, `x.a.b[i]`: the object changed."""
    while isinstance(n, (ast.Attribute, ast.Subscript)):
        n = n.value
    return n.id if isinstance(n, ast.Name) else None


def _changed(loop: ast.For | ast.AsyncFor) -> tuple[dict[str, int], set[str], set[str]]:
    """Names the loop assigns, stores into (`self.iter_num += 1`, `d[k] = v`),
    calls a method on or passes to a function (which may change the object:
    `train_one_epoch(epoch, env, meter)`), with a line where it does; the
    names it only passes; and those it stores into (changed for certain, as
    an assignment is)."""
    stored: dict[str, int] = {}
    into: dict[str, int] = {}
    called: dict[str, int] = {}
    passed: dict[str, int] = {}
    for n in _own_nodes(loop):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            stored[n.id] = min(stored.get(n.id, n.lineno), n.lineno)
        elif isinstance(n, (ast.Attribute, ast.Subscript)) and isinstance(n.ctx, ast.Store):
            base = _target_base(n)
            if base is not None:
                into[base] = min(into.get(base, n.lineno), n.lineno)
        elif isinstance(n, ast.Call):
            if isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name):
                called[n.func.value.id] = -n.lineno  # negative: changed through a method, maybe
            for a in [*n.args, *(k.value for k in n.keywords)]:
                if isinstance(a, ast.Name):
                    passed[a.id] = -n.lineno
    changed = set(called) | set(stored) | set(into)
    return {**passed, **called, **into, **stored}, set(passed) - changed, set(into) - set(stored)


def keep(v: Any, skip: set[int], shared: set[int]) -> Any:
    """`v` as the checkpoint keeps it (objstate.encode), or NotKept: what
    cannot be kept exactly, or is too large for a loop variable."""
    kept = objstate.encode(v, skip, shared)
    size = _tensor_bytes(kept)
    if size > MAX_VAR_BYTES:
        raise objstate.NotKept(f"its {size / 2**20:.0f} MiB of tensors are more than a loop variable may hold")
    return kept


def _closed_file(v: Any) -> bool:
    """A file a `with open(...) as f` closed: no state left to carry on
    (a later read of it fails loudly, resumed or not)."""
    return isinstance(v, io.IOBase) and v.closed


def _code(v: Any) -> bool:
    """A module, class or function: called through, never training state
    (`hs.log(...)`, `F.cross_entropy(...)` are not changes to `hs` or `F`)."""
    return isinstance(v, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType))


def _data_source(v: Any) -> bool:
    """A DataLoader, Dataset or Sampler: `iter(loader)` passes it, and what it
    yields is checked (batch fingerprints, a kept iterator's draws)."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and isinstance(v, (data.DataLoader, data.Dataset, data.Sampler))


def _is_data(v: Any) -> bool:
    """A tensor or array: a function it is passed to reads it (changing one
    in place is done through a method, which marks the name changed)."""
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    return (torch is not None and isinstance(v, torch.Tensor)) or (np is not None and isinstance(v, np.ndarray))


def _live(scope: ast.AST, loop: ast.For | ast.AsyncFor, into: set[str]) -> set[str]:
    """Names the recorded program reads after a change by the loop: outside
    the loop (nested functions included), or in the loop before its first
    assignment there (carried to the next iteration); an object the loop
    stores into (``into``), wherever it is read (the next iteration reads
    the changed object)."""
    inside = {id(n) for n in ast.walk(loop)}
    live = {
        n.id for n in ast.walk(scope) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and id(n) not in inside
    }
    first: dict[str, tuple[int, int]] = {}
    loads: list[ast.Name] = []
    for n in ast.walk(loop):
        if isinstance(n, ast.Name):
            if isinstance(n.ctx, ast.Store):
                first[n.id] = min(first.get(n.id, (1 << 30, 0)), (n.lineno, n.col_offset))
            else:
                loads.append(n)
    for n in loads:
        if n.id in first and (n.lineno, n.col_offset) < first[n.id]:
            live.add(n.id)
    live.update(n.id for n in ast.walk(loop) if isinstance(n, ast.Name) and n.id in into)
    # x += 1 reads x before it stores it.
    live.update(n.target.id for n in ast.walk(loop) if isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name))
    return live


#: A variable holding more tensor bytes than this is not checkpointed (an
#: activation such as nanoGPT's ``logits`` would dwarf the model's state).
MAX_VAR_BYTES = 64 << 20


def _tensor_bytes(v: Any) -> int:
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is not None and isinstance(v, torch.Tensor):
        return int(v.numel() * v.element_size())
    if np is not None and isinstance(v, np.ndarray):
        return int(v.nbytes)
    if type(v) in (list, tuple):
        return sum(_tensor_bytes(x) for x in v)
    if type(v) is dict:
        return sum(_tensor_bytes(x) for x in v.values())
    return 0


def _storages(v: Any) -> set[int]:
    """Storage addresses of the tensors in a value."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        ptr = objstate.storage_of(v)
        return set() if ptr is None else {ptr}
    if isinstance(v, (list, tuple)):
        return set().union(*(_storages(x) for x in v)) if v else set()
    if isinstance(v, dict):  # state dicts are OrderedDicts
        return set().union(*(_storages(x) for x in v.values())) if v else set()
    return set()


def _devices(v: Any) -> Any:
    """Where each tensor of a value lives (restored there), shaped like the value."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        return str(v.device)
    if type(v) in (list, tuple):
        return [_devices(x) for x in v]
    if type(v) is dict:
        return {k: _devices(x) for k, x in v.items()}
    return None


def _placed(v: Any, where: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        return v if where in (None, "cpu") else v.to(where)
    if type(v) in (list, tuple) and isinstance(where, list):
        return type(v)(_placed(x, w) for x, w in zip(v, where, strict=False))
    if type(v) is dict and isinstance(where, dict):
        return {k: _placed(x, where.get(k)) for k, x in v.items()}
    return v


_STATEFUL = (
    "torch.nn.Module",
    "torch.optim.Optimizer",
    "torch.optim.lr_scheduler.LRScheduler",
    "torch.optim.lr_scheduler.ReduceLROnPlateau",
    "torch.amp.GradScaler",
)


def _stateful_types() -> tuple[type, ...]:
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    out = []
    for path in _STATEFUL:
        obj: Any = torch
        for part in path.split(".")[1:]:
            obj = getattr(obj, part, None)
        if isinstance(obj, type):
            out.append(obj)
    return tuple(out)


def _has_state_dict(v: Any) -> bool:
    """Duck-typed state (not a class, nor a data loader: a loader's position
    is hs.loop's to restore)."""
    if isinstance(v, type) or not callable(getattr(v, "state_dict", None)):
        return False
    if not callable(getattr(v, "load_state_dict", None)) or type(v).__module__.startswith("hindsight"):
        return False
    return not hasattr(v, "__iter__")


def stateful_objects(frame: FrameType, loop_line: int | None = None) -> dict[str, tuple[Any, int]]:
    """Hands-free checkpointing: the modules, optimizers, LR schedulers and
    grad scalers, and any other object with a state_dict and a
    load_state_dict (timm's scheduler and loss scaler), that the `for` at
    the frame's line reads (directly or as
    arguments of the functions it calls), by variable name, with a line
    where it does. A module inside another one found is left to it."""
    tree = _tree(frame.f_code.co_filename)
    scope = _scope_of(tree, frame.f_code) if tree is not None else None
    loop = _loop_at(scope, loop_line or frame.f_lineno) if scope is not None else None
    kinds = _stateful_types()
    if loop is None or not kinds:
        return {}
    read: dict[str, int] = {}
    for n in ast.walk(loop):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            read[n.id] = min(read.get(n.id, n.lineno), n.lineno)
    found: dict[str, tuple[Any, int]] = {}
    seen: set[int] = set()
    for name, line in sorted(read.items(), key=lambda kv: kv[1]):
        v = frame.f_locals.get(name, frame.f_globals.get(name))
        if (isinstance(v, kinds) or _has_state_dict(v)) and id(v) not in seen:
            seen.add(id(v))
            found[name] = (v, line)
    torch = sys.modules["torch"]
    inner = {id(m) for v, _ in found.values() if isinstance(v, torch.nn.Module) for m in v.modules() if m is not v}
    return {k: (v, line) for k, (v, line) in found.items() if id(v) not in inner}


_UNSET = object()

# The analysis of one loop, by (file, its mtime, function, loop line): it runs
# when every block starts, and walking a long module's tree each time cost
# nanoGPT's 50 ms iterations 4 ms each.
_Found = tuple[dict[str, int], frozenset[str], frozenset[str], frozenset[str]]
_analysed: dict[tuple[str, float, str, int, int], _Found | None] = {}


def _analysis(code: Any, line: int) -> _Found | None:
    """(changed names with a line, names only passed, live names, names only
    stored into) of the
    `for` at `line` of `code`; None when its source cannot be read (an
    interactive session, exec)."""
    tree = _tree(code.co_filename)
    mtime = _mtime(code.co_filename)
    if tree is None or mtime is None:
        return None
    key = (code.co_filename, mtime, code.co_name, code.co_firstlineno, line)
    if key not in _analysed:
        scope = _scope_of(tree, code)
        loop = _loop_at(scope, line) if scope is not None else None
        if scope is None or loop is None:
            _analysed[key] = None
        else:
            # Every changed variable is kept, not only those the recorded code
            # reads later: a probe added for replay may read any of them.
            names, passed, into = _changed(loop)
            _analysed[key] = (names, frozenset(passed), frozenset(_live(scope, loop, into)), frozenset(into))
    return _analysed[key]


class LoopVars:
    """The variables one `hs.loop` body changes, in the frame that runs it."""

    def __init__(
        self,
        frame: FrameType,
        loop_name: str,
        names: dict[str, int],
        live: set[str],
        skip: set[int],
        passed: set[str] = frozenset(),  # type: ignore[assignment]
        into: set[str] = frozenset(),  # type: ignore[assignment]
    ):
        self.frame, self.loop_name, self.live, self.skip, self.passed = frame, loop_name, live, skip, passed
        self.into = into
        # Variables the loop changes through methods (maybe) that cannot be
        # kept (a progress bar, a summary writer): name -> type and why. Not
        # refused (most are), but named in the run's closing note.
        self.unkept: dict[str, str] = {}
        # Names the frame reads from its module (a function's loop stepping a
        # module-level environment): the module's own, kept by the run for
        # every checkpoint (ModuleVars), not only those taken in this loop.
        own = frame.f_locals is frame.f_globals or frame.f_code.co_name == "<module>"
        code = frame.f_code
        local = {*code.co_varnames, *code.co_cellvars, *code.co_freevars}
        self.globals = {n: line for n, line in names.items() if not own and (line < 0 or n in into) and n not in local}
        self.names = {n: line for n, line in names.items() if n not in self.globals}

    @classmethod
    def of(cls, frame: FrameType, loop_name: str, skip: set[int]) -> LoopVars | None:
        """For the `for ... in hs.loop(...)` that `frame` is executing; None
        when its source cannot be read (an interactive session, exec)."""
        found = _analysis(frame.f_code, frame.f_lineno)
        if found is None:
            return None
        names, passed, live, into = found
        return cls(frame, loop_name, dict(names), set(live), skip, set(passed), set(into))

    def without(self, other: LoopVars | None) -> dict[str, int]:
        if other is None or other.frame is not self.frame:
            return self.names
        return {n: line for n, line in self.names.items() if n not in other.names}

    def snapshot(self) -> dict[str, tuple[Any, tuple[int, ...]]]:
        """The variables' values now (lists and dicts copied, tensors with
        their version counter), for `capture(..., at=...)` in a checkpoint
        taken later: what the code before the steps read (see RecordRun._visit)."""
        out: dict[str, tuple[Any, tuple[int, ...]]] = {}
        local = self.frame.f_locals
        for name in self.names:
            v = local.get(name, _UNSET)
            if v is _UNSET or (name in self.passed and _is_data(v)):
                continue
            if type(v) is list:
                v = list(v)
            elif type(v) is dict:
                v = dict(v)
            elif not isinstance(v, (int, float, str, bytes, type(None))) and id(v) not in self.skip:
                # An object changes in place: keep its state as it is now.
                try:
                    v = objstate.encode(v, self.skip)
                except objstate.NotKept:
                    pass
            out[name] = (v, objstate.versions(v))
        return out

    def capture(
        self,
        names: dict[str, int],
        shared: set[int] = frozenset(),  # type: ignore[assignment]
        transient: set[str] = frozenset(),  # type: ignore[assignment]
        at: dict[str, tuple[Any, tuple[int, ...]]] | None = None,
    ) -> dict[str, Any]:
        """{"values": {name: value}, "devices": {name: ...}} of the storable
        ones. Tensors sharing storage with a checkpointed object's state
        (`w = model.weight.data`) are not kept: a restored copy would no
        longer alias the object, and writes through it would be lost.

        A variable the loop assigns and later code reads that cannot be kept
        (and is not in ``transient``) raises UnsupportedTypeError: a resume
        or a replay would go on with another value than the recorded run.

        ``at``: a `snapshot` to keep instead of the current values; what it
        cannot keep is left out, never refused (the current values are), and
        so is a tensor changed in place since (its old value is gone)."""
        values: dict[str, Any] = {}
        local = self.frame.f_locals
        for name, line in names.items():
            if at is None:
                v = local.get(name, _UNSET)
            else:
                v, seen = at.get(name, (_UNSET, ()))
                if v is not _UNSET and objstate.versions(v) != seen:
                    continue
            if v is _UNSET or (name in self.passed and _is_data(v)):
                continue
            if id(v) in self.skip:
                continue  # given to hs.checkpointing: saved through its state_dict
            if _storages(v) & shared:
                continue  # restored through the object it aliases
            try:
                values[name] = keep(v, self.skip, shared)
                continue
            except objstate.NotKept as e:
                why = str(e)
            if (
                at is None
                and line < 0
                and name in self.live
                and name not in transient
                and not _closed_file(v)
                and not _code(v)
                and not _data_source(v)
            ):
                self.unkept.setdefault(name, f"{type(v).__qualname__}: {why}")
            # A module or class stored into (`torch.backends.cudnn.benchmark =
            # True`, `os.environ[k] = v`) is process-wide configuration, set
            # again by the code that set it: not refused, as a call on it is not.
            stored_code = name in self.into and _code(v)
            if (
                at is None
                and line > 0
                and name in self.live
                and name not in transient
                and not _closed_file(v)
                and not stored_code
            ):
                fix = (
                    "keep what later code needs in a smaller variable (a .item(), a slice)"
                    if "MiB" in why
                    else f"if it has state_dict/load_state_dict, pass it: hs.checkpointing({name}=...)"
                )
                raise UnsupportedTypeError(
                    f"variable '{name}' (line {line}) is {'stored into' if name in self.into else 'assigned'} by loop "
                    f"'{self.loop_name}' and read later, but "
                    f"{why}: a resume or a replay would go on with another value than this run's. Fix: {fix}; "
                    f"or, if its value need not survive a resume (a progress bar, an open file), name it: "
                    f'hs.checkpointing(..., transient=["{name}"])'
                )
        return {"values": values, "devices": {k: _devices(v) for k, v in values.items()}}

    def restore(self, saved: dict[str, Any]) -> None:
        values, devices = saved.get("values", {}), saved.get("devices", {})
        if not values:
            return
        frame = self.frame
        module_level = frame.f_code.co_name == "<module>" or frame.f_locals is frame.f_globals
        local = frame.f_globals if module_level else frame.f_locals
        placed = {
            k: objstate.restore(local.get(k, objstate.MISSING), _placed(v, devices.get(k)), k)
            for k, v in values.items()
        }
        if module_level:
            frame.f_globals.update(placed)
            return
        local.update(placed)
        if sys.version_info < (3, 13):
            # Before PEP 667, f_locals is a snapshot: write it back.
            ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))


class ModuleVars:
    """Module-level objects that loops change from inside functions (the
    zoo's reinforce: `env.step(...)` in `main()`): kept with every checkpoint
    of the run once a loop has shown it changes them, restored in place."""

    def __init__(self) -> None:
        # (module name, variable) -> (the module's namespace, only passed)
        self.known: dict[tuple[str, str], tuple[dict[str, Any], bool]] = {}

    def add(self, lv: LoopVars | None) -> None:
        if lv is None:
            return
        g = lv.frame.f_globals
        for name in lv.globals:
            if name in g:
                self.known.setdefault((str(g.get("__name__")), name), (g, name in lv.passed))

    def capture(self, skip: set[int], shared: set[int]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for (module, name), (g, passed) in self.known.items():
            v = g.get(name, _UNSET)
            if v is _UNSET or id(v) in skip or (passed and _is_data(v)) or isinstance(v, (int, float, str, bytes)):
                continue
            try:
                values[f"{module}:{name}"] = keep(v, skip, shared)
            except objstate.NotKept:
                continue  # only called or passed: maybe not changed at all (a logger, a module)
        return {"values": values, "devices": {k: _devices(v) for k, v in values.items()}}

    def restore(self, saved: dict[str, Any]) -> None:
        devices = saved.get("devices", {})
        for key, v in saved.get("values", {}).items():
            module, _, name = key.rpartition(":")
            known = self.known.get((module, name))
            mod = sys.modules.get(module)
            g = known[0] if known is not None else vars(mod) if mod is not None else None
            if g is None:
                raise ReplayError(
                    f"the checkpoint holds {name!r} of module {module!r}, which this program has not loaded"
                )
            g[name] = objstate.restore(g.get(name, objstate.MISSING), _placed(v, devices.get(key)), name)

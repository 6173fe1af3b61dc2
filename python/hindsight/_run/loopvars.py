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
restored in place. A variable the loop assigns and later code reads
(before assigning it again: `_read_later`) that the store cannot hold is
refused when the first block ends, naming it, its line and the one-line
fix: checkpoint it through its ``state_dict``, or declare it ``transient``
(its value need not survive a resume: a progress bar, an open file).
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
from typing import Any, NamedTuple

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


def _live(
    scope: ast.AST, loop: ast.For | ast.AsyncFor, into: set[str], assigned: set[str], cell: bool = False
) -> set[str]:
    """Names the recorded program reads after a change by the loop: outside
    the loop where code after it may read the loop's value before assigning
    its own (_read_later), or in the loop before its first assignment there
    (carried to the next iteration); an object the loop stores into
    (``into``), wherever it is read (the next iteration reads the changed
    object). ``assigned``: the names the loop assigns; ``cell``: the scope
    is a notebook cell's."""
    # The loop's `else:` runs after its last iteration: code after the loop.
    inside = {id(n) for n in ast.walk(loop)} - {id(n) for s in loop.orelse for n in ast.walk(s)}
    outside: set[str] = set()
    for n in ast.walk(scope):
        if id(n) in inside:
            continue
        # `del x` and `x += 1` read x too (x unset by a resume fails them, or worse).
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Store):
            outside.add(n.id)
        elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
            outside.add(n.target.id)
    # A name the loop assigns, read outside but always assigned again first
    # (an evaluation loop reusing the training step's `outputs`), is not read
    # later (issue 41). An object the loop changes in place (`x.a = 1`,
    # `x.append(...)`) may be read through another name: read later as before.
    later = _read_later(scope, loop, frozenset(outside & assigned), cell)
    live = (outside - assigned) | later
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


# -- read later: where the loop's value may still be read --------------------
# A checkpoint is taken where the loop's iterations meet (between two steps,
# after the last) or, for an outer loop, inside its body; a resume goes on
# from there, after re-running the code before the steps from the values
# the outer iteration began with. A variable the loop assigns needs its value
# then only if some way on from there, or from the top of a loop around it,
# reads it before assigning it again. Backward liveness over the scope's
# statements finds those ways, erring towards "read": every loop may run no
# iteration, every statement may raise, a `with` body may be cut short
# unless its context manager is known to let exceptions through, and a name
# read by a nested function, lambda, class or generator (run at any later
# time), declared global or nonlocal, or where locals()/eval() can see it,
# is read later wherever it is.

#: Calls that can see every variable (`vars()` and `dir()` without an argument):
#: no name is known unread where they appear.
_DYNAMIC = frozenset({"locals", "globals", "eval", "exec", "breakpoint"})
_DYNAMIC_BARE = frozenset({"vars", "dir"})
#: Context managers that let an exception through (a `with` body under them runs
#: to its end or leaves by the exception): their body's assignments are certain.
_NO_SUPPRESS = frozenset(
    {
        "no_grad",
        "inference_mode",
        "enable_grad",
        "set_grad_enabled",
        "autocast",
        "accumulate",
        "no_sync",
        "nullcontext",
        "open",
    }
)
_DEFERRED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.GeneratorExp)


def _reads(node: ast.AST | None) -> set[str]:
    """Names an expression or a simple statement reads when it runs: loaded,
    deleted (`del x` of a name a resume left unset fails) or updated (`x +=
    1`); in a function, class or lambda definition only what the definition
    itself evaluates (their bodies are `_deferred`)."""
    out: set[str] = set()
    todo = [node] if node is not None else []
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo.extend([*n.decorator_list, n.args, *([n.returns] if n.returns else [])])
        elif isinstance(n, ast.ClassDef):
            todo.extend([*n.decorator_list, *n.bases, *(k.value for k in n.keywords)])
        elif isinstance(n, ast.Lambda):
            todo.append(n.args)
        elif isinstance(n, ast.GeneratorExp):
            todo.append(n.generators[0].iter)
        else:
            todo.extend(ast.iter_child_nodes(n))
    return out


def _bound(target: ast.AST | None) -> set[str]:
    """Names an assignment target binds (`x`, `x, (y, *z)`); `x.a = ...` and
    `x[i] = ...` bind none (they read x)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_bound(e) for e in target.elts))
    if isinstance(target, ast.Starred):
        return _bound(target.value)
    return set()


def _walrus(node: ast.AST | None) -> set[str]:
    """Names an expression certainly assigns: its `(x := ...)` outside
    `and`/`or`, `a if c else b`, lambdas and comprehensions."""
    out: set[str] = set()
    todo = [node] if node is not None else []
    while todo:
        n = todo.pop()
        if isinstance(n, ast.NamedExpr):
            out |= _bound(n.target)
        if not isinstance(n, (ast.BoolOp, ast.IfExp, ast.Lambda, *_COMPREHENSIONS)):
            todo.extend(ast.iter_child_nodes(n))
    return out


def _assigns(s: ast.stmt) -> set[str]:
    """Names a simple statement certainly assigns when it completes."""
    if isinstance(s, ast.Assign):
        return set().union(*(_bound(t) for t in s.targets)) | _walrus(s.value)
    if isinstance(s, ast.AnnAssign):
        return (_bound(s.target) if s.value is not None else set()) | _walrus(s.value)
    if isinstance(s, ast.AugAssign):
        return _bound(s.target) | _walrus(s.value)
    if isinstance(s, (ast.Import, ast.ImportFrom)):
        return {a.asname or a.name.split(".")[0] for a in s.names if a.name != "*"}
    if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {s.name}
    if isinstance(s, ast.Expr):
        return _walrus(s.value)
    return set()


def _lets_through(item: ast.withitem) -> bool:
    e = item.context_expr
    f = e.func if isinstance(e, ast.Call) else None
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
    return name in _NO_SUPPRESS


class _Jumps(NamedTuple):
    """What is live where control goes from a statement other than to the next one."""

    brk: frozenset[str]  # a `break`
    cont: frozenset[str]  # a `continue`
    exc: frozenset[str]  # an exception: a handler, a finally, or out of the scope
    ret: frozenset[str]  # a `return`


class _Liveness:
    """Backward liveness of `names` over a scope's statements, recording what
    is live where control leaves `loop` (its next iteration or its end, a
    `break`, a `return`, an exception) and at the top of the bodies of the
    loops `around` it."""

    def __init__(self, names: frozenset[str], loop: ast.AST, around: set[int]) -> None:
        self.names, self.loop, self.around = names, loop, around
        self.exits: frozenset[str] | None = None  # None: the loop was not reached
        self.tops: frozenset[str] = frozenset()
        self._memo: dict[int, tuple[frozenset[str], frozenset[str]]] = {}

    def _rw(self, node: ast.AST | None, kind: str = "expr") -> tuple[frozenset[str], frozenset[str]]:
        """(names read, names certainly assigned) of an expression, a target or a simple statement."""
        if node is None:
            return frozenset(), frozenset()
        key = id(node)
        if key not in self._memo:
            if kind == "target":
                assigned = _bound(node)
            elif isinstance(node, ast.stmt):
                assigned = _assigns(node)
            else:
                assigned = _walrus(node)
            self._memo[key] = (frozenset(_reads(node)) & self.names, frozenset(assigned) & self.names)
        return self._memo[key]

    def _through(self, node: ast.AST | None, live: frozenset[str], kind: str = "expr") -> frozenset[str]:
        read, assigned = self._rw(node, kind)
        return read | (live - assigned)

    def block(self, body: list[ast.stmt], out: frozenset[str], j: _Jumps) -> frozenset[str]:
        live = out
        for s in reversed(body):
            live = self.stmt(s, live, j)
        return live

    def _loop(self, s: ast.For | ast.AsyncFor | ast.While, out: frozenset[str], j: _Jumps) -> frozenset[str]:
        """What is live at the loop's head (before each test or next item), to a fixed point."""
        after = self.block(s.orelse, out, j)
        head: frozenset[str] = frozenset()
        for rounds in range(1 << 30):
            if rounds == 8:
                head = self.names  # everything: the most cautious fixed point
            body = self.block(s.body, head, j._replace(brk=out, cont=head))
            if isinstance(s, ast.While):
                top = body
                new = self._through(s.test, body | after) | j.exc
            else:
                top = self._through(s.target, body, "target")
                new = after | top | j.exc
            if new <= head:
                break
            head = new | head
        if s is self.loop:
            self.exits = (self.exits or frozenset()) | head | out | j.exc | j.ret
        elif id(s) in self.around:
            self.tops |= top  # a resume re-runs an iteration from the top
        return head

    def stmt(self, s: ast.stmt, out: frozenset[str], j: _Jumps) -> frozenset[str]:
        if isinstance(s, ast.If):
            return self._through(s.test, self.block(s.body, out, j) | self.block(s.orelse, out, j)) | j.exc
        if isinstance(s, (ast.For, ast.AsyncFor)):
            return self._through(s.iter, self._loop(s, out, j)) | j.exc
        if isinstance(s, ast.While):
            return self._loop(s, out, j)
        if isinstance(s, (ast.With, ast.AsyncWith)):
            # A body under a context manager that may swallow an exception
            # (contextlib.suppress, an unknown one) may stop anywhere and go on after the `with`.
            lets_through = all(_lets_through(item) for item in s.items)
            live = self.block(s.body, out, j if lets_through else j._replace(exc=j.exc | out))
            for item in reversed(s.items):
                live = self._through(item.context_expr, self._through(item.optional_vars, live, "target"))
            return live | j.exc
        if isinstance(s, (ast.Try, ast.TryStar)):
            inner, after = j, out
            if s.finalbody:
                # Conservative: the finally block may go on to any of the places.
                f = self.block(s.finalbody, out | j.exc | j.ret | j.brk | j.cont, j)
                inner, after = _Jumps(f, f, f, f), f
            caught: frozenset[str] = frozenset()
            for h in s.handlers:  # `except E as x`: x is unset again after the handler
                caught |= self._rw(h.type)[0] | self.block(h.body, after, inner)
            orelse = self.block(s.orelse, after, inner)
            return self.block(s.body, orelse, inner._replace(exc=inner.exc | caught)) | caught
        if isinstance(s, ast.Match):
            live = out | j.exc  # no case matched; a capture pattern assigns nothing certain
            for case in s.cases:
                live |= self._rw(case.pattern)[0] | self._rw(case.guard)[0] | self.block(case.body, out, j)
            return self._through(s.subject, live) | j.exc
        if isinstance(s, ast.Break):
            return j.brk
        if isinstance(s, ast.Continue):
            return j.cont
        if isinstance(s, ast.Return):
            return self._rw(s.value)[0] | j.ret | j.exc
        if isinstance(s, ast.Raise):
            return self._rw(s)[0] | j.exc
        return self._through(s, out, "stmt") | j.exc


def _deferred(scope: ast.AST) -> set[str]:
    """Names of `scope` that run at a time its statements do not show: read
    by a function, lambda, class or generator defined in it (a closure, or
    a module-level function reading a global), or declared global/nonlocal."""
    out: set[str] = set()
    for n in _own_nodes(scope):
        if isinstance(n, (ast.Global, ast.Nonlocal)):
            out.update(n.names)

    def visit(node: ast.AST, bound: frozenset[str], deferred: bool) -> None:
        own = _own_nodes(node)
        declared = {x for n in own if isinstance(n, (ast.Global, ast.Nonlocal)) for x in n.names}
        local: set[str] = set()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            local = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])]}
            local |= {n.id for n in own if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            local |= {n.name for n in own if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
            local |= set().union(*(_assigns(n) for n in own if isinstance(n, (ast.Import, ast.ImportFrom))))
        elif isinstance(node, _COMPREHENSIONS):
            local = set().union(*(_bound(g.target) for g in node.generators))
        local -= declared
        deferred = deferred or isinstance(node, _DEFERRED)
        if deferred:
            out.update(declared)
            out.update(
                n.id
                for n in own
                if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Store) and n.id not in local | bound
            )
        for n in own:
            if isinstance(n, (*_SCOPES, *_COMPREHENSIONS)):
                visit(n, bound | local, deferred)

    for n in _own_nodes(scope):
        if isinstance(n, (*_SCOPES, *_COMPREHENSIONS)):
            visit(n, frozenset(), False)
    return out


def _dynamic(n: ast.AST) -> bool:
    if not isinstance(n, ast.Call) or not isinstance(n.func, ast.Name):
        return False
    return n.func.id in _DYNAMIC or (n.func.id in _DYNAMIC_BARE and not n.args and not n.keywords)


def _read_later(scope: ast.AST, loop: ast.For | ast.AsyncFor, names: frozenset[str], cell: bool) -> set[str]:
    """Those of `names` (assigned by `loop`, read elsewhere in `scope`) that
    a resume from a checkpoint taken in the loop may read before assigning
    them again; all of them where that cannot be told."""
    body = getattr(scope, "body", None)
    if not names or not isinstance(body, list):
        return set(names)
    if any(_dynamic(n) for n in ast.walk(scope)):
        return set(names)
    # Leaving a function ends its variables; a notebook's later cells may read any of its cell's.
    end = names if cell and isinstance(scope, ast.Module) else frozenset()
    around = {
        id(n)
        for n in _own_nodes(scope)
        if isinstance(n, (ast.For, ast.AsyncFor, ast.While)) and n is not loop and any(m is loop for m in ast.walk(n))
    }
    flow = _Liveness(names, loop, around)
    flow.block(body, end, _Jumps(end, end, end, end))
    if flow.exits is None:
        return set(names)  # not reached: a statement this analysis does not know
    return set(flow.exits | flow.tops | (_deferred(scope) & names))


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
            assigned = {n for n, line in names.items() if line > 0} - into
            live = _live(scope, loop, into, assigned, cell=mtime == -1.0)
            _analysed[key] = (names, frozenset(passed), frozenset(live), frozenset(into))
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

    def unkept_reads(self, saved: dict[str, Any], objects: dict[str, Any], transient: set[str]) -> list[str]:
        """A replay restored this loop's checkpoint and skips its steps:
        the variables the loop assigns that the code after it reads before
        assigning them again (this program's reads: a probe's too) but the
        checkpoint does not hold, as `name (line N)`. The frame holds an older
        value of each (from before the skipped steps), and a probe reading it
        would log that: the replay must refuse. Not listed: unset ones (a
        read fails loudly), transient ones, the objects given to
        hs.checkpointing and what shares their tensors, data, code and
        closed files (never kept, nor needed)."""
        values = saved.get("values", {})
        local = self.frame.f_locals
        ids = {id(o) for o in objects.values()}
        shared: set[int] | None = None
        out = []
        for name, line in self.names.items():
            if line <= 0 or name not in self.live or name in values or name in transient:
                continue
            v = local.get(name, _UNSET)
            if v is _UNSET or id(v) in ids or _closed_file(v) or _code(v) or _data_source(v):
                continue
            if name in self.passed and _is_data(v):
                continue
            if shared is None:
                shared = _storages({k: o.state_dict() for k, o in objects.items() if hasattr(o, "state_dict")})
            if _storages(v) & shared:
                continue
            out.append(f"'{name}' (line {line})")
        return out

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

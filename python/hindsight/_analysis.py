"""Compare a recorded script with the one to replay.

This uses Python's own `ast` on purpose: the script must be parsed exactly as
the interpreter that runs it parses it (every syntax of every Python version
it supports), and a Rust parser would lag behind new syntax. The comparison
ignores comments and formatting: two scripts are replay-compatible when they
are equal after removing every `hs.log(...)` statement.
"""

from __future__ import annotations

import ast
import builtins
import difflib
from dataclasses import dataclass, field

from hindsight._effects import _MAX_DEPTH, _Aliases, _imported, _Script


@dataclass(frozen=True)
class Probe:
    """A `hs.log` call site: its log name and the `hs.loop` names around it, outermost first."""

    name: str
    loops: tuple[str, ...]
    line: int
    in_function: bool = False
    #: In the outer loop's body, before its inner (`hs.loop`) loop starts:
    #: it reads the state the previous iteration left.
    before_inner: bool = False
    #: The function the script never calls itself that holds it (a
    #: framework hook such as Lightning's `on_train_epoch_end`), if any.
    hook: str | None = None


# Lightning's hooks by the state they see (`hindsight.lightning` replays
# them): at the end of an epoch's training, where the epoch's checkpoint
# stands (validation runs on the model trained so far); and at its start,
# where the previous epoch's checkpoint stands. A probe in any other hook
# (training_step, on_before_optimizer_step, ...) needs the steps to run.
EPOCH_END_HOOKS = frozenset(
    {
        "on_train_epoch_end",
        "on_validation_epoch_start",
        "on_validation_epoch_end",
        "on_validation_start",
        "on_validation_end",
        "on_validation_batch_start",
        "on_validation_batch_end",
        "validation_step",
    }
)
EPOCH_START_HOOKS = frozenset({"on_train_epoch_start"})


# Lightning's hooks whose base implementation (LightningModule's, Callback's)
# does nothing and returns None, and whose presence Lightning never checks
# (`is_overridden`): a method of one of these names that holds only
# observing code, defined in a direct subclass of LightningModule or
# Callback, runs its probes and changes nothing else. Not `setup`,
# `teardown`, `configure_model` or the checkpoint hooks: state or presence matters there.
NOOP_HOOKS = frozenset(
    f"on_{stage}_{when}"
    for stage in ("train", "validation", "test", "predict")
    for when in ("start", "end", "epoch_start", "epoch_end", "batch_start", "batch_end")
) | frozenset(
    {
        "on_fit_start",
        "on_fit_end",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_before_zero_grad",
    }
)
# What such a class's base must be imported as (module, or module:name).
_LIGHTNING_MODULES = ("lightning.pytorch", "pytorch_lightning", "lightning")
_LIGHTNING_BASES = ("LightningModule", "Callback")


def _lightning_base(base: ast.expr, imports: dict[str, str]) -> bool:
    """`base` is Lightning's LightningModule or Callback, as the script imports it."""
    if isinstance(base, ast.Name):
        return any(imports.get(base.id) == f"{m}:{b}" for m in _LIGHTNING_MODULES for b in _LIGHTNING_BASES)
    if isinstance(base, ast.Attribute) and base.attr in _LIGHTNING_BASES:
        chain = base.value
        parts: list[str] = []
        while isinstance(chain, ast.Attribute):
            parts.insert(0, chain.attr)
            chain = chain.value
        if not isinstance(chain, ast.Name) or chain.id not in imports:
            return False
        root = imports[chain.id]
        if ":" in root:  # `from lightning import pytorch as pl`
            mod, _, name = root.partition(":")
            root = f"{mod}.{name}"
        module = ".".join([root, *parts])
        # `pl.callbacks.Callback` and `pl.Callback` are the same class.
        return module in _LIGHTNING_MODULES or module.removesuffix(".callbacks") in _LIGHTNING_MODULES
    return False


def _observing_hook(s: ast.stmt) -> bool:
    """A no-op Lightning hook method whose body, once stripped, holds nothing."""
    if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) or s.name not in NOOP_HOOKS or s.decorator_list:
        return False
    return all(
        isinstance(b, ast.Pass) or (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)) for b in s.body
    )


def _hook_kind(name: str) -> str | None:
    return "end" if name in EPOCH_END_HOOKS else "start" if name in EPOCH_START_HOOKS else None


@dataclass
class Analysis:
    compatible: bool
    differences: list[str]
    new_probes: list[Probe]
    outer_loops: list[str] = field(default_factory=list)

    #: The recorded loops are a framework's (Lightning's epochs): probes in
    #: its hooks are placed by the hook's name.
    framework: bool = False

    def _hook(self, p: Probe) -> str | None:
        return p.hook if self.framework and p.in_function else None

    @property
    def needs_inner_execution(self) -> bool:
        """True when some new probe sits inside an inner loop (or a function we cannot place)."""
        return any(
            len(p.loops) >= 2 or (p.in_function and self._hook(p) not in EPOCH_END_HOOKS | EPOCH_START_HOOKS)
            for p in self.new_probes
        )

    @property
    def needs_start_state(self) -> bool:
        """True when some new probe may run before the inner loop of an outer
        iteration (or in a function, whose call site we cannot place): it
        needs the state the previous iteration left, not a checkpoint's."""
        return any(p.before_inner or (p.in_function and self._hook(p) not in EPOCH_END_HOOKS) for p in self.new_probes)


def _const_str(call: ast.Call) -> str | None:
    if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def _bound(s: ast.stmt) -> list[str] | None:
    """The names an assignment binds, or None if it stores elsewhere (an
    attribute, a subscript) or is another statement."""
    targets = s.targets if isinstance(s, ast.Assign) else [s.target] if isinstance(s, ast.AnnAssign) else None
    if targets is None:
        return None
    names: list[str] = []
    for t in targets:
        for n in ast.walk(t):
            if isinstance(n, ast.Name):
                names.append(n.id)
            elif isinstance(n, (ast.Attribute, ast.Subscript)):
                return None
    return names


def _names(tree: ast.AST) -> set[str]:
    """Every name the code binds or reads."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.alias):
            out.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
    return out


class _StripProbes(ast.NodeTransformer):
    """Removes the statements that only observe: `hs.log`, and, where
    `script` (judging by the training code's names) is given, `print`,
    imports and assignments of names the training code never uses, and `if`
    blocks that hold nothing else. What an observing-looking statement
    writes keeps it (the scripts then differ), with the reason in `refused`.
    So does what an `hs.log` call's arguments write: a recorded one is then
    kept in both scripts (it ran when recording too: no difference), a new
    one only in the current script, which is refused."""

    def __init__(
        self,
        aliases: _Aliases,
        script: _Script | None,
        imports: dict[str, str] | None = None,
        own_imports: dict[str, str] | None = None,
    ) -> None:
        self.aliases = aliases
        self.script = script
        # What the recorded script's imports bind: importing the same again is no change.
        self.imports = imports or {}
        # What this script's imports bind (to recognize Lightning's base classes).
        self.own_imports = own_imports or {}
        self.refused: list[tuple[ast.stmt, str]] = []

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        if (
            isinstance(node, ast.ClassDef)
            and node.bases
            and not node.keywords
            and all(_lightning_base(b, self.own_imports) for b in node.bases)
        ):
            # A hook method added only to hold probes (`on_validation_epoch_end`
            # with an hs.log) overrides a base method that does nothing. Not
            # beside a mixin (it may define the hook), and only where nothing
            # else in the class binds the name (a second `def` replaces the first).
            bound: dict[str, int] = {}
            for st in node.body:
                defined = [st.name] if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else None
                for name in defined or _bound(st) or []:
                    bound[name] = bound.get(name, 0) + 1
            node.body = [
                st for st in node.body if not (_observing_hook(st) and bound.get(getattr(st, "name", ""), 0) == 1)
            ] or [ast.Pass()]
        for name in ("body", "orelse", "finalbody"):
            body = getattr(node, name, None)
            if isinstance(body, list) and body and all(isinstance(s, ast.stmt) for s in body):
                kept = [s for s in body if not self._observes(s)]
                if not kept and name == "body":
                    kept = [ast.Pass()]
                setattr(node, name, kept)
        return node

    def _observes(self, s: ast.stmt) -> bool:
        script = self.script
        if script is None:
            return isinstance(s, ast.Expr) and self.aliases.is_call(s.value, "log")
        core = script.core
        why: str | None = None
        if isinstance(s, ast.Expr) and (
            self.aliases.is_call(s.value, "log")
            or (isinstance(s.value, ast.Call) and ast.unparse(s.value.func) == "print")
        ):
            why = script.why(s.value, s)
        elif isinstance(s, ast.Expr):
            # Not an observing statement; say why, if the reason is plain.
            reason = script.why(s.value, s)
            if reason is not None:
                self.refused.append((s, reason))
            return False
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            rebinds = [n for n, what in _imported(s).items() if n in core and self.imports.get(n) != what]
            if rebinds:
                why = f"imports into '{rebinds[0]}', which the training code uses as something else"
        elif isinstance(s, ast.If):
            # Its blocks were stripped already (children first): only
            # observing statements were in them if nothing but `pass` is left.
            if not all(isinstance(b, ast.Pass) for b in [*s.body, *s.orelse]):
                return False
            why = script.why(s.test, s)
        elif isinstance(s, ast.Delete):
            self.refused.append((s, f"deletes {', '.join(ast.unparse(t) for t in s.targets)}"))
            return False
        else:
            bound = _bound(s)
            if bound is None:
                return False
            used = [n for n in bound if n in core]
            if used:
                why = f"assigns '{used[0]}', which the training code uses"
            else:
                value = s.value if isinstance(s, (ast.Assign, ast.AnnAssign)) else None
                why = script.why(value, s) if value is not None else None
        if why is not None:
            self.refused.append((s, why))
            return False
        return True


def _strip(
    src: str, filename: str, core: set[str] | None = None, imports: dict[str, str] | None = None
) -> tuple[ast.Module, _Aliases, _StripProbes]:
    tree = ast.parse(src, filename=filename)
    aliases = _Aliases(tree)
    # Judged on the whole script, before anything is stripped from it.
    script = _Script(tree, aliases, core) if core is not None else None
    own: dict[str, str] = {}
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            own.update(_imported(n))
    stripper = _StripProbes(aliases, script, imports, own)
    return stripper.visit(tree), aliases, stripper


@dataclass
class _Scope:
    """What one function body (or the module) holds, with `hs.loop` names
    relative to the body: log sites, loop headers, and calls by name."""

    logs: list[tuple[str, tuple[str, ...], int]] = field(default_factory=list)
    loops: list[tuple[str, tuple[str, ...], int]] = field(default_factory=list)
    calls: list[tuple[str, tuple[str, ...], int]] = field(default_factory=list)
    # Names bound to an instance of a class the script defines (`trainer =
    # Trainer(...)`), so that `trainer.train()` is followed into its method.
    instances: dict[str, str] = field(default_factory=dict)


def _loop_name(node: ast.For | ast.AsyncFor, aliases: _Aliases) -> str | None:
    """The `hs.loop` a `for` iterates, also through a wrapper such as
    `enumerate(hs.loop(...))` or `zip(hs.loop(...), ...)`."""
    for n in ast.walk(node.iter):
        if aliases.is_call(n, "loop"):
            assert isinstance(n, ast.Call)
            return _const_str(n) or "?"
        if isinstance(n, ast.Name) and n.id in aliases.loops:
            return aliases.loops[n.id]
    return None


def _callee(call: ast.Call, scope: _Scope, classes: dict[str, set[str]]) -> str | None:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        if f.value.id == "self":
            return f.attr  # self.train_epoch(...); not model.train() or opt.step()
        # trainer.train(...) where `trainer = Trainer(...)` and the script's
        # class Trainer defines train; model.train() stays torch's.
        cls = scope.instances.get(f.value.id)
        if cls is not None and f.attr in classes.get(cls, set()):
            return f.attr
    return None


def _classes(tree: ast.AST) -> dict[str, set[str]]:
    """The classes the script defines (at any depth), with their methods."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            methods = {s.name for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
            found.setdefault(node.name, set()).update(methods)
    return found


def _bind(scope: _Scope, stmt: ast.Assign | ast.AnnAssign, classes: dict[str, set[str]]) -> None:
    """Note (or forget) which names hold an instance of a script's class."""
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    value = stmt.value
    cls = None
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in classes:
        cls = value.func.id
    for t in targets:
        for n in ast.walk(t):
            if isinstance(n, ast.Name):
                if cls is not None and t is n:
                    scope.instances[n.id] = cls
                else:
                    scope.instances.pop(n.id, None)


def _scopes(tree: ast.AST, aliases: _Aliases) -> dict[str, list[_Scope]]:
    """Scopes by function name ("" = the module); a name defined twice has two."""
    scopes: dict[str, list[_Scope]] = {}
    classes = _classes(tree)

    def walk(node: ast.AST, scope: _Scope, loops: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Assign, ast.AnnAssign)):
                _bind(scope, child, classes)
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = _Scope()
                scopes.setdefault(child.name, []).append(inner)
                walk(child, inner, ())
                continue
            if isinstance(child, ast.Lambda):
                continue
            if isinstance(child, (ast.For, ast.AsyncFor)):
                name = _loop_name(child, aliases)
                if name is not None:
                    scope.loops.append((name, loops, child.lineno))
                    walk(child.iter, scope, loops)
                    for stmt in [*child.body, *child.orelse]:
                        walk(ast.Module(body=[stmt], type_ignores=[]), scope, (*loops, name))
                    continue
            if isinstance(child, ast.Expr) and aliases.is_call(child.value, "log"):
                assert isinstance(child.value, ast.Call)
                scope.logs.append((_const_str(child.value) or "?", loops, child.lineno))
            elif isinstance(child, ast.Call) and not aliases.is_call(child, "loop"):
                callee = _callee(child, scope, classes)
                if callee is not None:
                    scope.calls.append((callee, loops, child.lineno))
            walk(child, scope, loops)

    module = _Scope()
    scopes[""] = [module]
    walk(tree, module, ())
    return scopes


def probes(src: str, filename: str = "<script>") -> tuple[list[Probe], list[str]]:
    """Every `hs.log` site with the `hs.loop` names around it where it runs,
    outermost first, and the outermost loop names.

    Loops are followed through calls of functions defined in the script
    (`train()` holding the step loop, called from the epoch loop in
    `main()`), so a site's loops are those around it at run time. A site in
    a function whose call sites cannot all be found (a callback, a method
    called by a framework) is marked `in_function`: its place is unknown.
    """
    tree = ast.parse(src, filename=filename)
    aliases = _Aliases(tree)
    scopes = _scopes(tree, aliases)
    # Loop contexts each function runs in, from its call sites, to a fixpoint.
    entry: dict[str, set[tuple[str, ...]]] = {"": {()}}
    for _ in range(_MAX_DEPTH):
        grown = False
        for fname, bodies in scopes.items():
            for ctx in list(entry.get(fname, ())):
                for body in bodies:
                    for callee, loops, _line in body.calls:
                        if callee not in scopes or callee == "":
                            continue
                        new = (*ctx, *loops)
                        if new not in entry.setdefault(callee, set()):
                            entry[callee].add(new)
                            grown = True
        if not grown:
            break
    # Where the first inner loop of each outer iteration starts: a nested
    # loop header, or the call of a function that holds one; and the lines
    # at which functions are called directly in an outer loop's body.
    holds_loop = {f for f, bodies in scopes.items() if f and any(b.loops for b in bodies)}
    outer: list[str] = []
    first_inner: dict[str, int] = {}
    called_at: dict[str, list[tuple[str, int]]] = {}
    for fname, bodies in scopes.items():
        top = () in entry.get(fname, set())
        for body in bodies:
            for name, loops, line in body.loops:
                if top and not loops and name not in outer:
                    outer.append(name)
                if top and len(loops) == 1:
                    first_inner[loops[0]] = min(first_inner.get(loops[0], line), line)
            for callee, loops, line in body.calls:
                if top and len(loops) == 1:
                    called_at.setdefault(callee, []).append((loops[0], line))
                    if callee in holds_loop:
                        first_inner[loops[0]] = min(first_inner.get(loops[0], line), line)
    # Functions the script never calls itself: the framework hook that runs
    # each, through the helpers it calls (a helper all of whose callers are
    # hooks of one kind is placed as they are).
    callers: dict[str, set[str]] = {}
    for fname, bodies in scopes.items():
        for body in bodies:
            for callee, _loops, _line in body.calls:
                if callee in scopes and callee not in ("", fname):
                    callers.setdefault(callee, set()).add(fname)

    def hook_of(f: str, seen: tuple[str, ...] = ()) -> str:
        if _hook_kind(f) is not None or f in seen or len(seen) >= _MAX_DEPTH or not callers.get(f):
            return f
        up = sorted(hook_of(c, (*seen, f)) for c in callers[f])
        kinds = {_hook_kind(h) for h in up}
        return up[0] if len(kinds) == 1 and None not in kinds else f

    found: list[Probe] = []
    for fname, bodies in scopes.items():
        ctxs = entry.get(fname)
        for body in bodies:
            own_loop = min((line for _, loops, line in body.loops if not loops), default=None)
            for name, loops, line in body.logs:
                if not ctxs:  # never called from the script: its place is unknown
                    found.append(Probe(name, loops, line, in_function=True, hook=hook_of(fname)))
                    continue
                # The deepest context it can run in decides: an inner-loop
                # site must run its steps.
                full = max(((*c, *loops) for c in ctxs), key=len)
                before = False
                if len(full) == 1:
                    # No inner loop at all (one step per outer iteration):
                    # every site reads the state the previous iteration left.
                    block = first_inner.get(full[0])
                    if block is None:
                        before = True
                    elif loops == full:  # in the outer loop's own body
                        before = line < block
                    else:  # in a function run by the outer loop: before, unless shown after
                        sites = [ln for o, ln in called_at.get(fname, []) if o == full[0]]
                        after_call = bool(sites) and all(ln > block for ln in sites)
                        after_own = own_loop is not None and line > own_loop
                        before = not (after_call or after_own)
                found.append(Probe(name, full, line, in_function=False, before_inner=before))
    return found, outer


def analyze(recorded: str, current: str, filename: str = "<script>") -> Analysis:
    # The training code's names: the recorded script without its hs.log
    # statements. Added code that binds none of them and calls nothing that
    # writes only observes (a helper variable, an `if step % 5 == 0:` guard,
    # an import), and is set aside like hs.log.
    training = _strip(recorded, filename)[0]
    core = _names(training)
    imports: dict[str, str] = {}
    for n in ast.walk(training):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            imports.update(_imported(n))
    old_tree, _, _ = _strip(recorded, filename, core, imports)
    new_tree, _, stripper = _strip(current, filename, core, imports)
    old_dump = ast.dump(old_tree)
    new_dump = ast.dump(new_tree)
    differences: list[str] = []
    if old_dump != new_dump:
        diff = list(
            difflib.unified_diff(
                ast.unparse(old_tree).splitlines(),
                ast.unparse(new_tree).splitlines(),
                "recorded (without observing code)",
                "current (without observing code)",
                lineterm="",
                n=1,
            )
        )
        # The reasons for the statements the current script adds.
        added_lines = {line[1:].strip() for line in diff if line.startswith("+") and not line.startswith("+++")}
        differences = [
            f"line {st.lineno}: {ast.unparse(st).splitlines()[0]}: {why}"
            for st, why in stripper.refused
            if ast.unparse(st).splitlines()[0].strip() in added_lines
        ] + diff
    old_probes, _ = probes(recorded, filename)
    new_probes, outer = probes(current, filename)
    remaining = [(p.name, p.loops) for p in old_probes]
    added = []
    for p in new_probes:
        key = (p.name, p.loops)
        if key in remaining:
            remaining.remove(key)
        else:
            added.append(p)
    return Analysis(old_dump == new_dump, differences, added, outer)


# -- transplanting probes into an older version of the script ------------------


def _header(s: ast.stmt) -> tuple[str, ...]:
    """What identifies a statement across versions: a compound statement by
    its header (its body may have changed), any other by its whole text."""
    if isinstance(s, (ast.For, ast.AsyncFor)):
        return ("for", ast.dump(s.target), ast.dump(s.iter))
    if isinstance(s, ast.While):
        return ("while", ast.dump(s.test))
    if isinstance(s, ast.If):
        return ("if", ast.dump(s.test))
    if isinstance(s, (ast.With, ast.AsyncWith)):
        return ("with", *(ast.dump(i) for i in s.items))
    if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return ("def", s.name)
    if isinstance(s, (ast.Try, ast.TryStar)):
        return ("try",)
    if isinstance(s, ast.Match):
        return ("match", ast.dump(s.subject))
    return ("stmt", ast.dump(s))


_Chain = tuple[tuple[str, ...], ...]


def _blocks(tree: ast.Module) -> list[tuple[_Chain, list[ast.stmt]]]:
    """Every statement list with the headers (and field) of what encloses it."""
    out: list[tuple[_Chain, list[ast.stmt]]] = []

    def walk(body: list[ast.stmt], chain: _Chain) -> None:
        out.append((chain, body))
        for s in body:
            head = _header(s)
            for field_name in ("body", "orelse", "finalbody"):
                sub = getattr(s, field_name, None)
                if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                    walk(sub, (*chain, (*head, field_name)))
            for h in getattr(s, "handlers", []) or []:
                walk(h.body, (*chain, (*head, "except", ast.dump(h.type) if h.type else "")))
            for c in getattr(s, "cases", []) or []:
                walk(c.body, (*chain, (*head, "case", ast.dump(c.pattern))))

    walk(tree.body, ())
    return out


def _log_sites(tree: ast.Module, aliases: _Aliases) -> list[tuple[_Chain, tuple[str, ...] | None, str, ast.stmt]]:
    """(enclosing headers, the statement before it that is not a log, log name, statement) of every hs.log."""
    sites: list[tuple[_Chain, tuple[str, ...] | None, str, ast.stmt]] = []
    for chain, body in _blocks(tree):
        prev: tuple[str, ...] | None = None
        for s in body:
            if isinstance(s, ast.Expr) and aliases.is_call(s.value, "log"):
                assert isinstance(s.value, ast.Call)
                sites.append((chain, prev, _const_str(s.value) or "?", s))
            else:
                prev = _header(s)
    return sites


def transplant(recorded: str, current: str, filename: str = "<script>") -> tuple[str | None, list[str]]:
    """The recorded (older) script with the current script's new `hs.log`
    statements placed where they belong: after the same statement, inside
    the same enclosing loops and blocks, matched by their syntax. Returns
    (source, []) or, when some statement has no unique place, (None, what
    could not be placed)."""
    cur_tree = ast.parse(current, filename=filename)
    rec_tree = ast.parse(recorded, filename=filename)
    cur_aliases, rec_aliases = _Aliases(cur_tree), _Aliases(rec_tree)
    have = {(chain, prev, name) for chain, prev, name, _ in _log_sites(rec_tree, rec_aliases)}
    anchors: dict[tuple[_Chain, tuple[str, ...]], list[tuple[list[ast.stmt], ast.stmt]]] = {}
    starts: dict[_Chain, list[list[ast.stmt]]] = {}
    for chain, body in _blocks(rec_tree):
        starts.setdefault(chain, []).append(body)
        for s in body:
            anchors.setdefault((chain, _header(s)), []).append((body, s))
    problems: list[str] = []
    placed: dict[int, int] = {}  # id(anchor statement or block) -> statements inserted after it
    known = _names(rec_tree) | set(dir(builtins))
    for chain, prev, name, stmt in _log_sites(cur_tree, cur_aliases):
        if (chain, prev, name) in have:
            continue
        where = f"hs.log({name!r}) at line {stmt.lineno}"
        # Only hs.log statements move: one that reads a helper added beside it cannot.
        inside = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        inside |= {n.arg for n in ast.walk(stmt) if isinstance(n, ast.arg)}
        read = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        missing = sorted(read - inside - known)
        if missing:
            problems.append(f"{where}: reads {', '.join(missing)}, which the recorded script does not define")
            continue
        if prev is None:
            blocks = starts.get(chain, [])
            if len(blocks) != 1:
                problems.append(
                    f"{where}: {'no' if not blocks else 'more than one'} matching block in the recorded script"
                )
                continue
            body = blocks[0]
            at = placed.get(id(body), 0)
            body.insert(at, stmt)
            placed[id(body)] = at + 1
            continue
        found = anchors.get((chain, prev), [])
        if len(found) != 1:
            what = "its preceding statement is not" if not found else "its preceding statement is more than once"
            problems.append(f"{where}: {what} in the recorded script at the same place")
            continue
        body, anchor = found[0]
        at = body.index(anchor) + 1 + placed.get(id(anchor), 0)
        body.insert(at, stmt)
        placed[id(anchor)] = placed.get(id(anchor), 0) + 1
    if problems:
        return None, problems
    return ast.unparse(rec_tree) + "\n", []

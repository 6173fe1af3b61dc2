"""Compare a recorded script with the one to replay.

This uses Python's own `ast` on purpose: the script must be parsed exactly as
the interpreter that runs it parses it (every syntax of every Python version
it supports), and a Rust parser would lag behind new syntax. The comparison
ignores comments and formatting: two scripts are replay-compatible when they
are equal after removing every `hs.log(...)` statement.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass, field


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


@dataclass
class Analysis:
    compatible: bool
    differences: list[str]
    new_probes: list[Probe]
    outer_loops: list[str] = field(default_factory=list)

    @property
    def needs_inner_execution(self) -> bool:
        """True when some new probe sits inside an inner loop (or a function we cannot place)."""
        return any(len(p.loops) >= 2 or p.in_function for p in self.new_probes)

    @property
    def needs_start_state(self) -> bool:
        """True when some new probe may run before the inner loop of an outer
        iteration (or in a function, whose call site we cannot place): it
        needs the state the previous iteration left, not a checkpoint's."""
        return any(p.before_inner or p.in_function for p in self.new_probes)


class _Aliases:
    def __init__(self, tree: ast.AST) -> None:
        self.modules: set[str] = set()
        self.direct: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "hindsight":
                        self.modules.add(a.asname or "hindsight")
            elif isinstance(node, ast.ImportFrom) and node.module == "hindsight":
                for a in node.names:
                    self.direct[a.asname or a.name] = a.name

    def is_call(self, node: ast.AST, attr: str) -> bool:
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == attr and isinstance(f.value, ast.Name):
            return f.value.id in self.modules
        return isinstance(f, ast.Name) and self.direct.get(f.id) == attr


def _const_str(call: ast.Call) -> str | None:
    if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


class _StripLogs(ast.NodeTransformer):
    def __init__(self, aliases: _Aliases) -> None:
        self.aliases = aliases

    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        for name in ("body", "orelse", "finalbody"):
            body = getattr(node, name, None)
            if isinstance(body, list) and body and all(isinstance(s, ast.stmt) for s in body):
                kept = [s for s in body if not self._is_log_stmt(s)]
                if not kept and name == "body":
                    kept = [ast.Pass()]
                setattr(node, name, kept)
        return node

    def _is_log_stmt(self, s: ast.stmt) -> bool:
        return isinstance(s, ast.Expr) and self.aliases.is_call(s.value, "log")


def _strip(src: str, filename: str) -> tuple[ast.Module, _Aliases]:
    tree = ast.parse(src, filename=filename)
    aliases = _Aliases(tree)
    return _StripLogs(aliases).visit(tree), aliases


@dataclass
class _Scope:
    """What one function body (or the module) holds, with `hs.loop` names
    relative to the body: log sites, loop headers, and calls by name."""

    logs: list[tuple[str, tuple[str, ...], int]] = field(default_factory=list)
    loops: list[tuple[str, tuple[str, ...], int]] = field(default_factory=list)
    calls: list[tuple[str, tuple[str, ...], int]] = field(default_factory=list)


def _loop_name(node: ast.For | ast.AsyncFor, aliases: _Aliases) -> str | None:
    """The `hs.loop` a `for` iterates, also through a wrapper such as
    `enumerate(hs.loop(...))` or `zip(hs.loop(...), ...)`."""
    for n in ast.walk(node.iter):
        if aliases.is_call(n, "loop"):
            assert isinstance(n, ast.Call)
            return _const_str(n) or "?"
    return None


def _callee(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
        return f.attr  # self.train_epoch(...); not model.train() or opt.step()
    return None


def _scopes(tree: ast.AST, aliases: _Aliases) -> dict[str, list[_Scope]]:
    """Scopes by function name ("" = the module); a name defined twice has two."""
    scopes: dict[str, list[_Scope]] = {}

    def walk(node: ast.AST, scope: _Scope, loops: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
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
                callee = _callee(child)
                if callee is not None:
                    scope.calls.append((callee, loops, child.lineno))
            walk(child, scope, loops)

    module = _Scope()
    scopes[""] = [module]
    walk(tree, module, ())
    return scopes


# Nesting deeper than this through calls is not followed (recursion).
_MAX_DEPTH = 6


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
    found: list[Probe] = []
    for fname, bodies in scopes.items():
        ctxs = entry.get(fname)
        for body in bodies:
            own_loop = min((line for _, loops, line in body.loops if not loops), default=None)
            for name, loops, line in body.logs:
                if not ctxs:  # never called from the script: its place is unknown
                    found.append(Probe(name, loops, line, in_function=True))
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
    old_tree, _ = _strip(recorded, filename)
    new_tree, _ = _strip(current, filename)
    old_dump = ast.dump(old_tree)
    new_dump = ast.dump(new_tree)
    differences: list[str] = []
    if old_dump != new_dump:
        differences = [
            line
            for line in difflib.unified_diff(
                ast.unparse(old_tree).splitlines(),
                ast.unparse(new_tree).splitlines(),
                "recorded (without hs.log)",
                "current (without hs.log)",
                lineterm="",
                n=1,
            )
        ]
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
    for chain, prev, name, stmt in _log_sites(cur_tree, cur_aliases):
        if (chain, prev, name) in have:
            continue
        where = f"hs.log({name!r}) at line {stmt.lineno}"
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

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
from dataclasses import dataclass, field, replace


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


def probes(src: str, filename: str = "<script>") -> tuple[list[Probe], list[str]]:
    """Every `hs.log` site with its enclosing `hs.loop` names, and the outermost loop names."""
    tree = ast.parse(src, filename=filename)
    aliases = _Aliases(tree)
    found: list[Probe] = []
    outer: list[str] = []

    def visit(node: ast.AST, loops: tuple[str, ...], in_fn: bool) -> None:
        for child in ast.iter_child_nodes(node):
            child_loops, child_fn = loops, in_fn
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                child_fn = True
            if isinstance(child, (ast.For, ast.AsyncFor)) and aliases.is_call(child.iter, "loop"):
                assert isinstance(child.iter, ast.Call)
                name = _const_str(child.iter) or "?"
                if not loops and name not in outer:
                    outer.append(name)
                # The loop's iterable expression is outside the loop body.
                visit(child.iter, loops, in_fn)
                for stmt in [*child.body, *child.orelse]:
                    visit_stmt(stmt, (*loops, name), child_fn)
                continue
            if isinstance(child, ast.Expr) and aliases.is_call(child.value, "log"):
                assert isinstance(child.value, ast.Call)
                found.append(Probe(_const_str(child.value) or "?", loops, child.lineno, in_fn))
            visit(child, child_loops, child_fn)

    def visit_stmt(stmt: ast.stmt, loops: tuple[str, ...], in_fn: bool) -> None:
        wrapper = ast.Module(body=[stmt], type_ignores=[])
        visit(wrapper, loops, in_fn)

    visit(tree, (), False)
    # A probe directly in an outer loop's body, above the line where that
    # body's first inner `hs.loop` starts, runs before the inner loop.
    first_inner: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor)) and aliases.is_call(node.iter, "loop"):
            name = _const_str(node.iter)  # type: ignore[arg-type]
            if name in outer:
                lines = [
                    n.lineno
                    for stmt in node.body
                    for n in ast.walk(stmt)
                    if isinstance(n, (ast.For, ast.AsyncFor)) and aliases.is_call(n.iter, "loop")
                ]
                if lines:
                    first_inner[name] = min(lines)
    found = [replace(p, before_inner=len(p.loops) == 1 and p.line < first_inner.get(p.loops[0], -1)) for p in found]
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

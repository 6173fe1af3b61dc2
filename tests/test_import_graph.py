"""No import circles, in the Python package or in the Rust crates
(docs/architecture.md, "Import graph").

A circle makes two modules one: neither can change, be tested or be read
alone, and in Python it makes import order matter. Function-local imports
count (one hid a seven-module circle through `hindsight.accelerate`). A
module may name its own ancestors (a package's ``__init__``) and Rust test
modules may use anything: neither is a dependency between siblings.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _related(a: str, b: str, sep: str) -> bool:
    return a == b or a.startswith(b + sep) or b.startswith(a + sep)


def python_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at any depth of its code)."""
    mods: dict[str, Path] = {}
    for f in root.rglob("*.py"):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        package = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names: Iterable[str]
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                mod = ".".join(p for p in (base, node.module or "") if p)
                names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            else:
                continue
            for name in names:
                t = known(name)
                # An ancestor package is no sibling: Python runs it first.
                if t is not None and t != m and not m.startswith(t + "."):
                    graph[m].add(t)
    return graph


_TESTS = re.compile(r"#\[cfg\(test\)\]\s*mod tests\s*\{.*", re.S)
_PATH = re.compile(r"crate::([a-z_][a-z0-9_]*(?:::[a-z_][a-z0-9_]*)*)(?:::\{([^}]*)\})?")


def rust_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the crate's modules it uses (``crate::`` paths outside tests)."""
    mods: dict[str, Path] = {}
    for f in src.rglob("*.rs"):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] in ("mod", "lib", "main"):
            parts = parts[:-1]
        mods["::".join(parts)] = f
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        text = _TESTS.sub("", f.read_text())
        for base, group in _PATH.findall(text):
            for path in [f"{base}::{g.strip()}" for g in group.split(",") if g.strip()] if group else [base]:
                parts = path.split("::")
                while parts and "::".join(parts) not in mods:
                    parts.pop()
                t = "::".join(parts)
                if t and not _related(m, t, "::"):
                    graph[m].add(t)
    return graph


def test_the_python_package_has_no_import_circle() -> None:
    graph = python_graph(REPO / "python" / "hindsight")
    # The walk sees imports at every depth (else it proves nothing).
    assert "hindsight._run.common" in graph["hindsight._run.record"]
    assert "hindsight._run.accelstate" in graph["hindsight._run.objstate"]
    assert _cycles(graph) == []


def test_the_rust_crates_have_no_module_circle() -> None:
    crates = sorted(p for p in (REPO / "crates").iterdir() if (p / "src").is_dir())
    assert len(crates) >= 4
    found = {}
    for crate in crates:
        graph = rust_graph(crate / "src")
        found[crate.name] = _cycles(graph)
        if crate.name == "hindsight-core":
            assert "checkpoint::store" in graph["checkpoint::writer"]
            assert "checkpoint::cancel" in graph["checkpoint::store"]
    assert all(not c for c in found.values()), found


def test_a_circle_is_found() -> None:
    """The detector itself, on a graph with one circle and one chain."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]

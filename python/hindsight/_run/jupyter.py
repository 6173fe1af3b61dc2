"""Jupyter notebooks: in a kernel the run's script is the notebook, not
``ipykernel_launcher.py``. This module finds which notebook a kernel runs,
the program's arguments there (none: the kernel's own are not the
notebook's), the source a recording keeps (the executed cells), and turns a
notebook's code cells into the Python script that `hindsight replay` plans
and runs (IPython magics that are safe to drop are dropped; any other is
refused, naming the cell and the line)."""

from __future__ import annotations

import ast
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from hindsight.errors import InvalidArgumentError, ReplayError

SUFFIX = ".ipynb"

#: Set by `hs.notebook(path)`: wins over what the kernel says.
_EXPLICIT: Path | None = None

# Line magics that only change how the kernel shows things or reloads
# modules: a script without them computes the same values.
_DROP_LINE = re.compile(r"^%(matplotlib|config|load_ext\s+autoreload|autoreload|reload_ext\s+autoreload)\b")
# Cell magics whose body runs once as plain code (timing, output capture
# without a variable to capture into).
_DROP_CELL = re.compile(r"^%%(time|capture)\s*$")


def shell() -> Any | None:
    """The IPython shell of the Jupyter kernel this process is, else None
    (a plain interpreter, a replay worker, a terminal IPython)."""
    if "ipykernel" not in sys.modules:
        return None
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    ip = get() if get is not None else None
    return ip if ip is not None and getattr(ip, "kernel", None) is not None else None


def checked(path: str | os.PathLike[str]) -> Path:
    """`hs.notebook(path)`'s notebook, as an absolute path."""
    p = Path(path).expanduser().resolve()
    if p.suffix != SUFFIX or not p.is_file():
        raise InvalidArgumentError(f"hs.notebook({os.fspath(path)!r}): no notebook (.ipynb file) at {p}")
    return p


def set_path(p: Path) -> None:
    """`hs.notebook(path)`: which notebook this kernel runs."""
    global _EXPLICIT
    _EXPLICIT = p


def path(ip: Any) -> Path:
    """The notebook kernel `ip` runs: hs.notebook(), else VS Code's
    `__vsc_ipynb_file__`, else Jupyter's session name (`__session__`, env
    JPY_SESSION_NAME). None of them: refused, since the working directory
    may hold several notebooks whose runs must not resume each other."""
    if _EXPLICIT is not None:
        return _EXPLICIT
    ns = getattr(ip, "user_ns", {})
    found = [
        ("VS Code's __vsc_ipynb_file__", ns.get("__vsc_ipynb_file__")),
        ("the kernel's __session__", ns.get("__session__")),
        ("JPY_SESSION_NAME", os.environ.get("JPY_SESSION_NAME")),
    ]
    for what, value in found:
        if not isinstance(value, str) or not value:
            continue
        p = (Path.cwd() / Path(value).expanduser()).resolve()
        if p.suffix == SUFFIX and p.is_file():
            return p
        raise InvalidArgumentError(
            f"hindsight in a Jupyter kernel: {what} is {value!r}, which is no notebook file here "
            f"(working directory {Path.cwd()}); call hs.notebook('NAME.ipynb') before the first hs.* call"
        )
    raise InvalidArgumentError(
        "hindsight in a Jupyter kernel: which notebook runs here is not known (no JPY_SESSION_NAME, "
        "__session__ or __vsc_ipynb_file__); call hs.notebook('NAME.ipynb') before the first hs.* call, "
        f"or start the kernel with JPY_SESSION_NAME=/path/to/NAME.ipynb (working directory {Path.cwd()})"
    )


def _runs_a_script() -> bool:
    """`%run train.py` in the kernel: IPython sets sys.argv to the script's
    for as long as it runs, and that script is the run's, not the notebook."""
    argv0 = sys.argv[0] if sys.argv else ""
    return argv0.endswith(".py") and os.path.basename(argv0) not in ("ipykernel_launcher.py", "__main__.py")


def program() -> tuple[Path | None, list[str]]:
    """(the notebook, if this is a kernel; the program's argv: the
    notebook alone in a kernel, whose own argv is its connection file)."""
    ip = shell()
    if ip is None or _runs_a_script():
        return None, sys.argv[:]
    nb = path(ip)
    return nb, [str(nb)]


# -- notebook -> script -------------------------------------------------------
def _cells(nb_path: Path) -> list[tuple[int, str]]:
    """(1-based position among the notebook's cells, source) of its code cells."""
    try:
        nb = json.loads(nb_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ReplayError(f"{nb_path}: not a readable notebook ({e})") from None
    cells = nb.get("cells") if isinstance(nb, dict) else None
    if not isinstance(cells, list):
        raise ReplayError(f"{nb_path}: not a notebook of nbformat 4 (no list of cells)")
    out = []
    for n, cell in enumerate(cells, 1):
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        src = cell.get("source", "")
        out.append((n, "".join(src) if isinstance(src, list) else str(src)))
    return out


def _magic(line: str) -> bool:
    """An IPython magic, shell escape or help request: no Python."""
    s = line.strip()
    return (
        s.startswith(("%", "!"))
        or re.match(r"^[\w.]+\s*=\s*[%!]", s) is not None
        or (s.endswith("?") and not s.startswith("#"))
    )


def _cell_script(src: str, where: str, ipython: Any | None) -> str:
    """One cell as Python. Magics that are safe to drop become `pass` (lines
    keep their numbers); any other is refused naming `where` and the line,
    unless `ipython` (the kernel's shell, when recording) is given: then
    the cell is kept as IPython runs it, and a replay refuses it."""
    try:
        ast.parse(src)
        return src
    except SyntaxError:
        pass
    lines = src.split("\n")
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is not None and lines[first].lstrip().startswith("%%"):
        if _DROP_CELL.match(lines[first].strip()):
            lines[first] = "pass  # " + lines[first].strip()
        else:
            return _refuse(src, f"{where}, line {first + 1}: {lines[first].strip()!r}", ipython)
    for i, line in enumerate(lines):
        if i == first and line.startswith("pass  # %%"):
            continue
        if _magic(line):
            s = line.strip()
            if not _DROP_LINE.match(s):
                return _refuse(src, f"{where}, line {i + 1}: {s!r}", ipython)
            lines[i] = line[: len(line) - len(line.lstrip())] + "pass  # " + s
    out = "\n".join(lines)
    try:
        ast.parse(out)
    except SyntaxError as e:
        if ipython is not None:
            return _refuse(src, "", ipython)
        raise ReplayError(f"{where}, line {e.lineno}: syntax error: {e.msg}") from None
    return out


def _refuse(src: str, what: str, ipython: Any | None) -> str:
    if ipython is not None:
        # What the kernel ran: valid Python calling get_ipython().
        return str(ipython.transform_cell(src))
    raise ReplayError(
        f"{what}: IPython magics and shell escapes cannot run as a plain Python script, so this "
        "notebook cannot be replayed as it is (only %matplotlib, %config, %load_ext/%autoreload, "
        "%%time and %%capture are dropped safely); move that line out of the notebook"
    )


def _joined(cells: list[tuple[str, str]]) -> str:
    return "".join(f"# %% {label}\n{src}\n\n" for label, src in cells)


def script_of(nb_path: Path, ipython: Any | None = None) -> str:
    """The notebook's code cells in order as one Python script (what
    `jupyter nbconvert --to script` gives, magics dropped or refused)."""
    name = nb_path.name
    return _joined([(f"cell {n}", _cell_script(src, f"{name}, cell {n}", ipython)) for n, src in _cells(nb_path)])


def recorded_source(nb_path: Path) -> str:
    """The source a recording keeps for the notebook: the cells this kernel
    executed, in their order. When they are the notebook's first code
    cells as saved, the notebook's remaining cells follow (as a script's
    whole file is kept): the source is then exactly what `hindsight replay`
    runs, so a replay compares like with like."""
    ip = shell()
    history = getattr(ip, "history_manager", None)
    raw = list(getattr(history, "input_hist_raw", None) or [""])[1:]  # [0] is IPython's placeholder
    # IPython keeps a cell without its trailing newlines.
    executed = [src.rstrip() for src in raw if src.strip()]
    try:
        saved = _cells(nb_path)
    except ReplayError:
        saved = []
    code = [src.rstrip() for _, src in saved if src.strip()]
    if executed == code[: len(executed)]:
        return script_of(nb_path, ip)
    return _joined(
        [(f"In[{n}]", _cell_script(src, f"{nb_path.name}, In[{n}]", ip)) for n, src in enumerate(raw, 1) if src.strip()]
    )


def on_cell_error(run: Any) -> None:
    """A cell whose exception leaves the training loop ends the run as an
    uncaught exception ends a script: "interrupted" for a KeyboardInterrupt
    (the kernel's stop button; running the notebook again resumes it),
    "failed" otherwise. IPython shows the exception and the kernel goes on,
    so no excepthook sees it; by then the loop's generators are closed, as
    a script's are when its excepthook runs. An error in a cell that ran no
    outer loop (a plot after training) leaves the run as it is."""
    ip = shell()
    if ip is None:
        return

    def pre_run_cell(info: Any) -> None:
        run.pos.loop_started = False

    def post_run_cell(result: Any) -> None:
        error = getattr(result, "error_in_exec", None)
        if error is None or run.finished:
            return
        if run.pos.loop_started or run.pos.stack:
            run.finish("interrupted" if isinstance(error, KeyboardInterrupt) else "failed")

    ip.events.register("pre_run_cell", pre_run_cell)
    ip.events.register("post_run_cell", post_run_cell)

"""Replay workers forked from the zygote (`hindsight._zygote`): a child is
`python script.py` with the request's argv, directory, environment, standard
streams and progress descriptor, and its exit status comes back."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from hindsight._zygote import Zygote, preload_modules

SCRIPT = """
import os, signal, sys
print("out", sys.argv[1:], os.getcwd(), os.environ["ZYGOTE_TEST"], flush=True)
print("ctrl-c raises", signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
print("err", __name__, sys.path[0], file=sys.stderr, flush=True)
os.write(int(os.environ["PROGRESS_FD"]), f"{os.getppid()}\\n".encode())
import atexit
atexit.register(lambda: print("atexit ran", flush=True))
if sys.argv[1] == "fail":
    raise ValueError("bad input")
if sys.argv[1] == "hang":
    import time
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


def _read_all(fd: int) -> str:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode()


def test_a_forked_worker_is_the_script_run_with_its_request(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    work = tmp_path / "cwd"
    work.mkdir()
    z = Zygote(["json"], dict(os.environ))
    try:
        results = {}
        for arg in ("3", "fail", "hang"):
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            prog_r, prog_w = os.pipe()
            env = {**os.environ, "ZYGOTE_TEST": arg, "PROGRESS_FD": str(prog_w)}
            n = z.fork([sys.executable, str(script), arg], str(work), env, (out_w, err_w, prog_w), 1)
            for fd in (out_w, err_w, prog_w):
                os.close(fd)
            if arg == "hang":
                time.sleep(0.5)
                z.kill(signal.SIGKILL)
            results[arg] = (z.wait(n), _read_all(out_r), _read_all(err_r), _read_all(prog_r))
        status, out, err, progress = results["3"]
        assert status == 3
        assert f"out ['3'] {work} 3" in out and "atexit ran" in out  # argv, cwd, env; exit work done
        assert "ctrl-c raises True" in out  # though the zygote itself ignores SIGINT
        assert f"err __main__ {tmp_path}" in err  # run as __main__, its directory first on sys.path
        assert progress.strip() == str(z.proc.pid)  # forked from the zygote, through the progress descriptor
        status, out, err, _ = results["fail"]
        assert status == 1 and "ValueError: bad input" in err and "atexit ran" in out
        status, *_ = results["hang"]
        assert status == -signal.SIGKILL
    finally:
        z.close()
    assert z.proc.returncode == 0  # the zygote ends when the driver closes its socket


def test_preloaded_modules_are_the_heavy_top_level_imports() -> None:
    src = "import os\nimport torch\nfrom lightning.pytorch import Trainer\nimport numpy as np\nimport mylib\n"
    src += "def f():\n    import pandas\n"
    assert preload_modules(src) == ["torch", "lightning.pytorch", "numpy"]
    assert preload_modules("this is not python(") == []


def _run(z: Zygote, argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    out_r, out_w = os.pipe()
    with open(os.devnull, "wb") as devnull:
        n = z.fork([sys.executable, *argv], str(cwd), env, (out_w, devnull.fileno(), devnull.fileno()), 1)
    os.close(out_w)
    return z.wait(n), _read_all(out_r)


def test_a_forked_child_is_python_c_or_m_with_its_pythonpath_and_its_own_random_streams(tmp_path: Path) -> None:
    """What a new interpreter would differ in: `-c` and `-m` run as
    `__main__`, the request's PYTHONPATH is importable, and `random` and
    numpy draw other numbers in each child (a fork would repeat the zygote's
    streams: unseeded draws equal across workers)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "zyg_mod.py").write_text("import sys\nprint('module', __name__, sys.argv[1:])\n")
    draw = "import random, sys, numpy; print(__name__, sys.argv[1:], random.random(), numpy.random.rand())"
    env = {**os.environ, "PYTHONPATH": str(lib)}
    z = Zygote(["numpy"], dict(os.environ))
    try:
        status, out = _run(z, ["-m", "zyg_mod", "a"], tmp_path, env)
        assert (status, out.strip()) == (0, "module __main__ ['a']")
        draws = [_run(z, ["-c", draw, "b"], tmp_path, env) for _ in range(2)]
        assert [s for s, _ in draws] == [0, 0]
        (first, second) = (o.split() for _, o in draws)
        assert first[:2] == second[:2] == ["__main__", "['b']"]
        assert first[2] != second[2] and first[3] != second[3]
    finally:
        z.close()

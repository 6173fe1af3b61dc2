"""Test scripts started from a pre-imported interpreter.

Most tests run a training script or a `hindsight` command to completion in a
subprocess. A fresh interpreter imports torch again each time (2-3 s here,
Lightning 5-8 s), and the suite starts about a thousand of them. This module
forks those runs instead from one process that imported the heavy libraries
once: hindsight's own replay zygote (`hindsight._zygote`), which becomes
`python <argv>` in each child (a script, `-c` or `-m`, with the request's
environment, directory, PYTHONPATH, thread count and fresh random streams).
The variables an interpreter or a preloaded library may read at start-up
(PYTHON*, TORCH*, OMP_*, CUDA_*, LD_*, PL_*, ...) are those the zygote
started with: a run with other values goes to a zygote started with them.

`conftest.py` routes `subprocess.run([sys.executable, ...])` (and the
`hindsight` console script) here. Where a fork could differ from a fresh
interpreter, the call starts a fresh one as before:
- a test marked `fresh_process` (it depends on how the interpreter starts:
  hash seeds, import-time warnings, a process tree);
- interpreter flags other than `-c`/`-m`, standard input, `pass_fds`,
  `start_new_session`, a shell, or any other option this module does not know;
- a call from another thread, or while another forked run is in flight.

`Popen` is never routed: tests that signal, stop or watch a process keep a
real child of their own. `pytest --no-fork` turns the routing off.
"""

from __future__ import annotations

import locale
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from hindsight._zygote import Zygote

# Imported once in the fork server (those the tests' scripts import; none
# starts a thread or initializes CUDA at import).
PRELOAD = ("torch", "numpy", "pandas", "lightning", "transformers", "accelerate")

# Variables an interpreter or a preloaded library may read at start-up: a
# run with other values than a zygote's goes to a zygote started with them.
STARTUP_PREFIXES = ("PYTHON", "TORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "CUDA_", "NVIDIA_", "LD_", "MALLOC_", "PL_")
APPLIED_IN_CHILD = {"PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "MKL_NUM_THREADS"}
KNOWN_OPTIONS = {"capture_output", "text", "universal_newlines", "timeout", "cwd", "env", "check", "stdout", "stderr"}
_ENCODING = locale.getpreferredencoding(False)


def _startup_vars(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and k not in APPLIED_IN_CHILD}


class NotStarted(Exception):
    """The fork server could not start the run (it is not usable)."""


class ForkServer:
    """The zygotes of one test process, started at the first run that needs each."""

    def __init__(self, default_threads: int) -> None:
        self.default_threads = default_threads
        self.zygotes: dict[tuple[tuple[str, str], ...], Zygote] = {}  # by start-up variables
        self.started = 0
        self.lock = threading.Lock()  # one forked run at a time
        self.broken = False
        self.enabled = True  # off for a test marked fresh_process
        self.forked = 0
        self.fresh: dict[str, int] = {}  # Python runs started afresh, by reason

    def refusal(self, argv: Any, kw: dict[str, Any]) -> str | None:
        """Why `subprocess.run(argv, **kw)` needs a fresh interpreter; None if it can fork."""
        if not isinstance(argv, list | tuple) or len(argv) < 2:
            return "not an argv list"
        args = [os.fspath(a) for a in argv]
        if args[0] == sys.executable:
            if (args[1] in ("-c", "-m") and len(args) < 3) or (args[1].startswith("-") and args[1] not in ("-c", "-m")):
                return f"interpreter option {args[1]}"
        elif not _is_console_script(args[0]):
            return "not python"
        if not self.enabled:
            return "marked fresh_process"
        if self.broken:
            return "fork server unusable"
        if not set(kw) <= KNOWN_OPTIONS:
            return "option " + ", ".join(sorted(set(kw) - KNOWN_OPTIONS))
        if threading.current_thread() is not threading.main_thread():
            return "another thread"
        return None

    def run(self, argv: list[Any], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """Run `argv` forked; `NotStarted` where no child was started."""
        args = [os.fspath(a) for a in argv]
        if args[0] != sys.executable:
            args = [sys.executable, *args]  # a console script is a Python script
        env = {k: str(v) for k, v in (kw.get("env") if kw.get("env") is not None else os.environ).items()}
        cwd = os.fspath(kw["cwd"]) if kw.get("cwd") is not None else os.getcwd()
        threads = int(env.get("OMP_NUM_THREADS") or self.default_threads)
        text = bool(kw.get("text") or kw.get("universal_newlines"))
        with self.lock, _Outputs(kw.get("stdout"), kw.get("stderr"), bool(kw.get("capture_output"))) as outs:
            try:
                zygote = self._zygote(env)
                with open(os.devnull, "wb") as devnull:
                    n = zygote.fork(args, cwd, env, (outs.fd(1), outs.fd(2), devnull.fileno()), threads)
            except OSError as e:
                self.broken = True  # fresh interpreters from now on
                raise NotStarted(str(e)) from e
            self.forked += 1
            try:
                status = _wait(zygote, n, kw.get("timeout"))
            except subprocess.TimeoutExpired:
                os.kill(zygote.pids[n], 9)
                zygote.wait(n)
                out, err = outs.read(text)
                raise subprocess.TimeoutExpired(argv, kw["timeout"], out, err) from None
            out, err = outs.read(text)
        result = subprocess.CompletedProcess(argv, status, out, err)
        if kw.get("check"):
            result.check_returncode()
        return result

    def _zygote(self, env: dict[str, str]) -> Zygote:
        """A zygote started with `env`'s start-up variables (the last two kept:
        a test that sets one for its runs does not restart the common one)."""
        key = tuple(sorted(_startup_vars(env).items()))
        zygote = self.zygotes.pop(key, None)
        if zygote is None or zygote.proc.poll() is not None:
            base = {k: v for k, v in os.environ.items() if not k.startswith(STARTUP_PREFIXES) or k in APPLIED_IN_CHILD}
            zygote = Zygote(list(PRELOAD), {**base, **dict(key)})
            self.started += 1
        self.zygotes[key] = zygote  # the most recently used last
        while len(self.zygotes) > 2:
            self.zygotes.pop(next(iter(self.zygotes))).close()
        return zygote

    def close(self) -> None:
        for zygote in self.zygotes.values():
            zygote.close()
        self.zygotes.clear()


def _is_console_script(path: str) -> bool:
    """The `hindsight` entry point pip wrote beside this interpreter."""
    return Path(path) == Path(sys.executable).parent / "hindsight"


def _wait(zygote: Zygote, n: int, timeout: float | None) -> int:
    if timeout is None:
        return zygote.wait(n)
    deadline = time.monotonic() + timeout
    zygote.sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        while n not in zygote.status:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([], timeout)
            zygote.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                zygote._read()
            except TimeoutError:
                continue
        return zygote.status[n]
    finally:
        zygote.sock.settimeout(None)


class _Outputs:
    """The child's standard output and error: captured in temporary files
    (no pipe to drain while waiting), or the descriptors the caller gave."""

    def __init__(self, stdout: Any, stderr: Any, capture: bool) -> None:
        self.spec = {1: subprocess.PIPE if capture else stdout, 2: subprocess.PIPE if capture else stderr}
        self.files: dict[int, IO[bytes]] = {}
        self.fds: dict[int, int] = {}

    def __enter__(self) -> _Outputs:
        for k, spec in self.spec.items():
            if spec == subprocess.PIPE:
                self.files[k] = tempfile.TemporaryFile()
                self.fds[k] = self.files[k].fileno()
            elif spec == subprocess.DEVNULL:
                self.files[k] = open(os.devnull, "wb")  # closed in __exit__
                self.fds[k] = self.files[k].fileno()
            elif spec == subprocess.STDOUT and k == 2:
                self.fds[k] = self.fds[1]
            elif spec is None:
                self.fds[k] = k
            elif isinstance(spec, int):
                self.fds[k] = spec
            else:
                self.fds[k] = spec.fileno()
        return self

    def fd(self, k: int) -> int:
        return self.fds[k]

    def read(self, text: bool) -> tuple[Any, Any]:
        got: list[Any] = []
        for k in (1, 2):
            if self.spec[k] != subprocess.PIPE:
                got.append(None)
                continue
            f = self.files[k]
            f.seek(0)
            data = f.read()
            # As subprocess does with text=True: the locale's codec, universal newlines.
            got.append(data.decode(_ENCODING).replace("\r\n", "\n").replace("\r", "\n") if text else data)
        return got[0], got[1]

    def __exit__(self, *exc: object) -> None:
        for f in self.files.values():
            f.close()


def routed_run(server: ForkServer, real: Callable[..., Any]) -> Callable[..., Any]:
    """`subprocess.run` that forks what `server` accepts and runs the rest as before."""

    def run(argv: Any, *args: Any, **kw: Any) -> Any:
        why = "positional options" if args else server.refusal(argv, kw)
        if why is None:
            try:
                return server.run(argv, **kw)
            except NotStarted as e:
                why = f"fork server unusable: {e}"
        if why != "not python":
            server.fresh[why] = server.fresh.get(why, 0) + 1
        return real(argv, *args, **kw)

    return run

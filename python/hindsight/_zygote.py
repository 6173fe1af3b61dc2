"""Replay workers forked from one process that has imported the heavy
libraries already (a zygote), instead of each starting an interpreter and
importing torch (about 2 s) or Lightning (about 4.5 s) again.

`hindsight replay` starts the zygote when it has two or more workers to run
(one worker gains nothing: it would wait for the same import). The zygote
imports the libraries the script imports at its top level from an allow-list
of heavy packages without import-time effects, then forks one child per
worker request. The child takes the request's standard output, standard
error and progress descriptors (passed over a Unix socket), environment,
directory and argv, sets torch's thread count, and runs the script as
`__main__`, as `python script.py` (or `-c`, `-m`) would. Each child's exit status comes back
over the socket. Nothing in the zygote runs in parallel before a fork (an
import starts no OpenMP or CUDA work), so the children start clean.

Protocol (one socket pair, lines of JSON from the zygote):
  driver -> zygote: a JSON request, with 3 file descriptors (SCM_RIGHTS)
  zygote -> driver: {"ready": true} once imported; {"id": n, "pid": p} per
  fork; {"id": n, "status": s} when child n exits (s < 0: killed by -s).
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import gc
import io
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any

# Imported in the zygote when the script imports them at its top level.
PRELOAD = ("torch", "torchvision", "torchaudio", "numpy", "pandas", "scipy", "lightning", "pytorch_lightning")


def preload_modules(source: str) -> list[str]:
    """The modules of the allow-list the script imports at its top level (dotted names as written)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found: list[str] = []
    for node in tree.body:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            if name.split(".")[0] in PRELOAD and name not in found:
                found.append(name)
    return found


# -- the driver's side ---------------------------------------------------------------
class Zygote:
    """A started zygote: `fork()` a worker, `wait()` for its status. A worker's
    argv is a script's, `-c CODE` or `-m MODULE`, after the interpreter."""

    def __init__(self, modules: list[str], env: dict[str, str]) -> None:
        self.sock, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hindsight._zygote", str(theirs.fileno()), *modules],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        theirs.close()
        self._buf = b""
        self.pids: dict[int, int] = {}
        self.status: dict[int, int] = {}
        self._next = 0
        try:
            msg = self._read()
        except OSError:
            msg = {"why": "it exited"}
        if not msg.get("ready"):
            self.close()
            raise OSError(f"the replay zygote is not usable: {msg.get('why', msg)}")

    def _read(self) -> dict[str, Any]:
        while b"\n" not in self._buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise OSError("replay zygote exited")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        msg: dict[str, Any] = json.loads(line)
        if "status" in msg:
            self.status[msg["id"]] = msg["status"]
        return msg

    def fork(self, argv: list[str], cwd: str, env: dict[str, str], fds: tuple[int, int, int], threads: int) -> int:
        """A worker running `argv` (interpreter first) with (stdout, stderr,
        progress) as those descriptors; the progress one keeps its number.
        Returns the request id."""
        n, self._next = self._next, self._next + 1
        request = {"id": n, "argv": argv[1:], "cwd": cwd, "env": env, "progress_fd": fds[2], "threads": threads}
        socket.send_fds(self.sock, [json.dumps(request).encode() + b"\n"], list(fds))
        while n not in self.pids:
            msg = self._read()
            if msg.get("id") == n and "error" in msg:
                raise OSError(f"replay zygote could not start worker: {msg['error']}")
            if "pid" in msg:
                self.pids[msg["id"]] = msg["pid"]
        return n

    def wait(self, n: int) -> int:
        """The exit status of worker `n` (negative: killed by that signal)."""
        while n not in self.status:
            self._read()
        return self.status[n]

    def kill(self, sig: int = signal.SIGTERM) -> None:
        for n, pid in self.pids.items():
            if n not in self.status:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        self.sock.close()  # the zygote ends at EOF
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the zygote's side -------------------------------------------------------------------
def _fresh_interpreter_state(env: dict[str, str]) -> None:
    """What a new interpreter would differ in from a fork: the import path
    from `env`'s PYTHONPATH, unbuffered output under PYTHONUNBUFFERED, and
    random streams seeded anew (`random` and numpy seed from the OS at
    import; a fork would hand every child the zygote's state, so unseeded
    draws would repeat across workers)."""
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = [os.path.abspath(p) for p in extra if os.path.abspath(p) not in sys.path]
    if env.get("PYTHONUNBUFFERED"):
        for fd, name in ((1, "stdout"), (2, "stderr")):
            old = getattr(sys, name)
            raw = open(fd, "wb", buffering=0, closefd=False)  # the process's own stream, kept open
            setattr(sys, name, io.TextIOWrapper(raw, old.encoding, old.errors, write_through=True))
    import random

    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _run_main(argv: list[str]) -> None:
    """Run `argv` (the interpreter's arguments) as `__main__`, as `python
    <argv>` would: a script, `-c CODE` or `-m MODULE`."""
    import runpy
    import types

    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)  # what `python -c` does
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _child(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become `python <argv>` and never return."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
        out, err, progress = fds
        os.dup2(out, 1)
        os.dup2(err, 2)
        if progress != request["progress_fd"]:
            os.dup2(progress, request["progress_fd"])
        for fd in {out, err, progress} - {1, 2, request["progress_fd"]}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        _fresh_interpreter_state(request["env"])
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(int(request["threads"]))
        try:
            _run_main(list(request["argv"]))
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback, status 1
            traceback.print_exc()
            code = 1
        try:
            atexit._run_exitfuncs()  # the run's own exit work (logs flushed, progress summary)
        except BaseException:  # noqa: BLE001 - an exit handler's failure is reported, as at exit
            traceback.print_exc()
            code = code or 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(sock: socket.socket) -> None:
    # Ctrl-C reaches the whole process group: the workers stop (the driver
    # reports it); the zygote ends when the driver closes the socket.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    children: dict[int, int] = {}  # pid -> request id
    buf = b""
    fds: list[int] = []
    open_ = True

    def send(msg: dict[str, Any]) -> None:
        try:
            sock.sendall(json.dumps(msg).encode() + b"\n")
        except OSError:
            pass  # the driver went away; the children still finish

    send({"ready": True})
    while open_ or children:
        events = sel.select(timeout=0.05) if open_ else []
        if events:
            data, got, _flags, _addr = socket.recv_fds(sock, 1 << 20, 16)
            fds += got
            if not data:
                open_ = False
                sel.unregister(sock)
                for pid in children:  # the driver is gone: so is its replay
                    os.kill(pid, signal.SIGTERM)
            buf += data
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                request = json.loads(line)
                mine, fds = fds[:3], fds[3:]
                try:
                    pid = os.fork()
                except OSError as e:
                    send({"id": request["id"], "error": str(e)})
                    for fd in mine:
                        os.close(fd)
                    continue
                if pid == 0:
                    sock.close()
                    _child(request, mine)
                for fd in mine:
                    os.close(fd)
                children[pid] = request["id"]
                send({"id": request["id"], "pid": pid})
        elif not open_:
            time.sleep(0.05)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            n = children.pop(pid)
            send({"id": n, "status": os.waitstatus_to_exitcode(status)})


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    # A CUDA driver initialized before fork() fails in every child: torch's
    # availability check goes through NVML here, which forks safely.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    for name in sys.argv[2:]:
        # A module that fails to import here is imported by the worker
        # itself, which then reports its error as a fresh interpreter would.
        with contextlib.suppress(Exception):
            __import__(name)
    # This module is hindsight's, so `import hindsight` ran before the
    # imports above; tag DataLoader iterators as it would have after them.
    from hindsight._run import dataiter

    dataiter.install()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        sock.sendall(json.dumps({"ready": False, "why": "an import initialized CUDA"}).encode() + b"\n")
        return
    # The imported modules' objects go to the collector's permanent
    # generation: a child's collections then walk only its own objects, and
    # never touch (so never copy) the pages it shares with the zygote.
    gc.collect()
    gc.freeze()
    serve(sock)


if __name__ == "__main__":
    main()
    # Nothing of the zygote's needs finalizing, and some extensions' teardown
    # prints warnings (nanobind's leak report) that are not the user's.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

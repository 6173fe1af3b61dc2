"""The ``local`` launcher: workers as processes of this machine."""

from __future__ import annotations

import os
import selectors
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hindsight._launch import LaunchContext, Worker, progress, progress_lines, stderr_tail
from hindsight._run import ENV_HOME, ENV_REPLAY, files

# Bytes of a local worker's standard error kept for the report.
_STDERR_KEPT = 16384


@dataclass
class _Running:
    """A started worker's pipes: progress lines and standard error."""

    worker: Worker
    progress_fd: int
    err_fd: int
    err: bytes = b""
    partial: bytes = b""
    open_pipes: int = 2


class Starter(Protocol):
    """How a local worker process comes to be: started afresh, or forked from a zygote."""

    def start(self, w: Worker, cwd: Path, env: dict[str, str], progress_fd: int, quiet: bool) -> int:
        """Start `w`; returns the read end of its standard error."""

    def closed(self, w: Worker, err_fd: int) -> None:
        """Its standard error reached its end: release what reads it."""

    def wait(self, w: Worker) -> int: ...

    def close(self, kill: bool) -> None: ...


class Spawn:
    """Each worker started afresh (`subprocess.Popen`)."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, w: Worker, cwd: Path, env: dict[str, str], progress_fd: int, quiet: bool) -> int:
        proc = subprocess.Popen(
            w.argv,
            cwd=cwd,
            env=env,
            pass_fds=(progress_fd,),
            stdout=subprocess.DEVNULL if quiet else None,
            stderr=subprocess.PIPE,
        )
        assert proc.stderr is not None
        self.procs[id(w)] = proc
        return proc.stderr.fileno()

    def closed(self, w: Worker, err_fd: int) -> None:
        stderr = self.procs[id(w)].stderr
        assert stderr is not None
        stderr.close()

    def wait(self, w: Worker) -> int:
        return self.procs.pop(id(w)).wait()

    def close(self, kill: bool) -> None:
        for proc in self.procs.values():
            if kill:
                proc.kill()
            proc.wait()


def thread_env(n: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}


class LocalLauncher:
    """Workers as processes of this machine, writing into the project's
    logs.db: at most `budget` at a time, over all runs' workers."""

    local = True

    def run(self, workers: list[Worker], ctx: LaunchContext) -> None:
        from hindsight._launch.zygote import start_zygote

        total = sum(w.visits for w in workers)
        sel = selectors.DefaultSelector()
        waiting = list(workers)
        running = 0
        env0 = {**os.environ, **thread_env(workers[0].threads)}
        # A torchrun job is started afresh: its ranks are torchrun's children.
        forks = len(workers) >= 2 and not any(w.torchrun for w in workers)
        starter: Starter = (start_zygote(workers, env0) if forks else None) or Spawn()
        with tempfile.TemporaryDirectory(prefix="hindsight-replay-") as tmp:

            def launch(n: int, w: Worker) -> None:
                r, wfd = os.pipe()
                plan_path = Path(tmp) / f"worker-{n}.json"
                # The worker protocol: hindsight_core::runs::replay.
                plan_path.write_text(w.plan.to_json(wfd, None, w.replay_id, w.exact))
                # Its own working directory: files the script writes are its own (files.py).
                own = Path(tmp) / f"cwd-{n}"
                files.mirror(Path(w.cwd), own)
                env = {
                    **os.environ,
                    ENV_REPLAY: str(plan_path),
                    ENV_HOME: str(ctx.home),
                    files.ENV_RECORDED_CWD: w.cwd,
                    files.ENV_CONCURRENT: "1" if ctx.budget > 1 and len(workers) > 1 else "0",
                    **thread_env(w.threads),
                }
                try:
                    err_fd = starter.start(w, own, env, wfd, ctx.quiet)
                finally:
                    os.close(wfd)
                run = _Running(w, r, err_fd)
                # Standard error is read as it comes, beside the progress pipe:
                # a worker that writes more than a pipe holds (64 KiB) would
                # otherwise block on it, and the replay with it.
                for fd in (r, err_fd):
                    os.set_blocking(fd, False)
                    sel.register(fd, selectors.EVENT_READ, run)

            try:
                launched = 0
                while waiting or running:
                    while waiting and running < ctx.budget:
                        launch(launched, waiting.pop(0))
                        launched += 1
                        running += 1
                    for key, _ in sel.select(timeout=0.5):
                        p: _Running = key.data
                        chunk = os.read(key.fd, 65536)
                        if chunk and key.fd == p.progress_fd:
                            # Whole lines only: a read may end inside one.
                            p.partial += chunk
                            done, _, p.partial = p.partial.rpartition(b"\n")
                            progress_lines(p.worker, done.decode())
                            continue
                        if chunk:
                            p.err = (p.err + chunk)[-_STDERR_KEPT:]
                            continue
                        sel.unregister(key.fd)
                        if key.fd == p.err_fd:
                            starter.closed(p.worker, key.fd)
                        else:
                            os.close(key.fd)
                        p.open_pipes -= 1
                        if p.open_pipes == 0:
                            p.worker.returncode = starter.wait(p.worker)
                            p.worker.stderr_tail = stderr_tail(p.err.decode(errors="replace"))
                            running -= 1
                    progress(workers, total, ctx.start)
            finally:
                starter.close(kill=running > 0)
            progress(workers, total, ctx.start, final=True)

    def finish(self, ok: bool) -> None:
        pass  # the workers' directories went with the temporary directory

"""The ``zygote`` way to start local workers: forked from one process that
imported the heavy libraries their scripts import (`hindsight._zygote`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hindsight import _settings
from hindsight._launch import Worker
from hindsight._zygote import Zygote, preload_modules


class ZygoteStarter:
    def __init__(self, zygote: Zygote) -> None:
        self.zygote = zygote
        self.ids: dict[int, int] = {}

    def start(self, w: Worker, cwd: Path, env: dict[str, str], progress_fd: int, quiet: bool) -> int:
        er, ew = os.pipe()
        out = os.open(os.devnull, os.O_WRONLY) if quiet else os.dup(1)
        try:
            self.ids[id(w)] = self.zygote.fork(w.argv, str(cwd), env, (out, ew, progress_fd), w.threads)
        finally:
            os.close(out)
            os.close(ew)
        return er

    def closed(self, w: Worker, err_fd: int) -> None:
        os.close(err_fd)

    def wait(self, w: Worker) -> int:
        return self.zygote.wait(self.ids.pop(id(w)))

    def close(self, kill: bool) -> None:
        if kill:
            self.zygote.kill()
        self.zygote.close()


def start_zygote(workers: list[Worker], env: dict[str, str]) -> ZygoteStarter | None:
    """A zygote for `workers`; None where it cannot run (no fork, or
    $HINDSIGHT_REPLAY_FORK=0): workers then start afresh."""
    if not _settings.flag(_settings.REPLAY_FORK, True) or not hasattr(os, "fork"):
        return None
    modules: list[str] = []
    for script in {w.argv[1] for w in workers if len(w.argv) > 1}:
        try:
            source = Path(script).read_text()
        except (OSError, UnicodeDecodeError):
            continue
        modules += [m for m in preload_modules(source) if m not in modules]
    try:
        return ZygoteStarter(Zygote(modules, env))
    except OSError as e:
        print(f"note: replay workers start afresh ({e})", file=sys.stderr)
        return None

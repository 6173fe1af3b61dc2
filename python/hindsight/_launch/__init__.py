"""Launchers: how `hindsight replay` starts its worker processes and follows
them to their end. The driver (`hindsight.replay`, with the engine's
`runs::replay` for plans and `runs::replay::driver` for run selection)
decides what each worker does; a launcher only places the workers:

- ``local``: processes of this machine, at most ``budget`` at a time, forked
  from a zygote that imported the scripts' heavy libraries once (``zygote``)
  or started afresh;
- ``slurm``: one Slurm job array, each task writing into a database of its own.

A new launcher (Kubernetes, Ray, submitit) implements `Launcher` and is
added to `LAUNCHERS`; the driver does not change. Every launcher hands
each worker its plan file (`WorkerPlan.to_json`, the worker protocol of
`runs::replay`), sets `HINDSIGHT_REPLAY`/`HINDSIGHT_HOME`, gives it its own
working directory mirroring the recorded one (`files.mirror`), counts its
progress lines (`progress_lines`) and sets `returncode`/`stderr_tail`."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hindsight import _native

__all__ = [
    "LAUNCHERS",
    "LaunchContext",
    "Launcher",
    "Worker",
    "launcher",
    "progress",
    "progress_lines",
    "stderr_tail",
]


@dataclass
class Worker:
    """One worker process of one run's replay."""

    index: int
    modes: dict[int, str]
    plan: Any
    run_id: str = ""
    argv: list[str] = field(default_factory=list)
    cwd: str = ""
    #: Its processes: a run recorded by several ranks replays as a torchrun job of as many
    #: (of one, where the worker only restores).
    ranks: int = 1
    #: Started by hindsight's torchrun (a job of its own, not forked from a zygote).
    torchrun: bool = False
    #: Its progress lines as read so far (the engine's reader of the worker protocol).
    progress: Any = field(default_factory=lambda: _native.Progress())
    returncode: int | None = None
    stderr_tail: str = ""
    # The replay the worker stages its values for, and its torch threads.
    replay_id: int = 0
    threads: int = 1
    #: Runs with the recording's thread count: its state must equal the checkpoints'.
    exact: bool = True

    @property
    def done(self) -> int:
        return int(self.progress.done)

    @property
    def steps(self) -> int:
        return int(self.progress.steps)

    @property
    def bodies(self) -> int:
        """Iterations without an inner loop whose body it executed."""
        return int(self.progress.bodies)

    @property
    def restored(self) -> int:
        return int(self.progress.restored)

    @property
    def visits(self) -> int:
        return sum(1 for m in self.modes.values() if m != "skip")


@dataclass
class LaunchContext:
    """What a launcher needs beside the workers."""

    home: Path
    #: The project's run database (a launcher whose workers cannot share it merges their values).
    db: Any
    #: At most this many workers at once (local), or the array's width.
    budget: int
    start: float
    quiet: bool = False
    #: Options for the batch system (`--sbatch=...`).
    options: list[str] = field(default_factory=list)
    #: CPUs each batch task asks for: its worker's ranks x threads (core `runs::replay::driver::threads`).
    task_cpus: int = 1


class Launcher(Protocol):
    #: Whether the workers share this machine's cores (the thread budget applies).
    local: bool

    def run(self, workers: list[Worker], ctx: LaunchContext) -> None:
        """Start every worker, follow them to their end, set each one's
        `returncode` and `stderr_tail`."""

    def finish(self, ok: bool) -> None:
        """After the report: clean up what the workers left (or say where it is kept)."""


def progress(workers: list[Worker], total: int, start: float, final: bool = False) -> None:
    """The progress bar over every worker."""
    done = sum(w.done for w in workers)
    width = 30
    filled = int(width * done / max(total, 1))
    per = " ".join(f"w{i}:{w.done}/{w.visits}" for i, w in enumerate(workers))
    line = f"\rreplay [{'#' * filled}{'-' * (width - filled)}] {done}/{total} iterations  {per}  {time.monotonic() - start:.1f}s"
    if sys.stderr.isatty():
        sys.stderr.write(line + ("\n" if final else ""))
    elif final:
        sys.stderr.write(line.lstrip("\r") + "\n")
    sys.stderr.flush()


# A line that names why a process failed: hindsight's own, or the last line
# of a traceback (a rank's, prefixed by torchrun).
_CAUSE = re.compile(r"^(\[rank\d+\]: )?(hindsight: |[\w.]*(Error|Exception|Interrupt): )")


def stderr_tail(text: str, keep: int = 2000) -> str:
    """What the report shows of a worker's standard error: its end, after
    the lines before it that name a cause (a divergence a rank named, a
    rank's exception), ahead of the noise a torchrun job ends with (the
    other ranks' tracebacks of the connection that closed, the launcher's
    summary)."""
    tail = text[-keep:]
    if len(text) <= keep:
        return tail
    causes = list(dict.fromkeys(line for line in text[:-keep].splitlines() if _CAUSE.match(line)))
    return "\n".join([*causes[:10], tail])


def progress_lines(w: Worker, text: str) -> None:
    """Whole progress lines of a worker (the protocol of runs::replay)."""
    w.progress.read(text)


def launcher(name: str) -> Launcher:
    """The launcher `--launcher NAME` names."""
    make = LAUNCHERS.get(name)
    if make is None:
        raise ValueError(f"--launcher {name}: one of {', '.join(sorted(LAUNCHERS))}")
    return make()


def _local() -> Launcher:
    from hindsight._launch.local import LocalLauncher

    return LocalLauncher()


def _slurm() -> Launcher:
    from hindsight._launch.slurm import SlurmLauncher

    return SlurmLauncher()


LAUNCHERS: dict[str, Callable[[], Launcher]] = {"local": _local, "slurm": _slurm}

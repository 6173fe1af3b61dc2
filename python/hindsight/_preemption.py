"""Preemption, shared by `hs.checkpointing` and the Lightning callback: which
signals mean "checkpoint and leave" and the handlers that catch them, the
exit code the batch system expects, the Slurm requeue, and the
stop-then-exit sequence. One copy of each, so the two front ends cannot
drift."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
from typing import Any, NoReturn

from hindsight import _native, _settings


def signals(catch_sigint: bool) -> list[int]:
    """The signals that ask for a checkpoint and a clean exit."""
    sigs: list[int] = [signal.SIGTERM, signal.SIGUSR1]
    if catch_sigint:
        sigs.append(signal.SIGINT)
    return sigs


# SIGUSR1s that came while no training loop was active (see `_outside`).
_noted_outside: list[int] = []


def _outside(signum: int, frame: Any) -> None:
    """SIGUSR1 after a training loop ended. Its default action would kill the
    process, and with it the code after the loop (a final save, evaluation):
    a batch system's time warning (`--signal=B:USR1@90`) often lands there.
    Noted instead; a later training loop honours it at its first step."""
    if not _noted_outside:
        print(
            f"hindsight: {signal.Signals(signum).name} after the training loop ended: noted, not fatal "
            "(a later training loop would checkpoint and exit at its first step)",
            file=sys.stderr,
            flush=True,
        )
    _noted_outside.append(signum)


# Whether hindsight's stop handlers were ever installed in this process
# (a run, a framework callback or `hindsight.dist` started).
_started: list[bool] = []


def _early(signum: int, frame: Any) -> None:
    """A stop signal while no run of this process listens: before the first
    one started (data loading, model build) or after it ended. Its default
    action would kill the process with no word; this says why it leaves and
    exits with the signal's conventional code (128 + N): there is nothing to
    checkpoint, and no run is left half-written."""
    code = 128 + signum
    when = "after this process's run ended" if _started else "before this process started a run"
    print(
        f"hindsight: {signal.Signals(signum).name} {when}: nothing to checkpoint; exiting with {code}",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(code)


def install_early() -> None:
    """From `import hindsight`: `_early` for SIGTERM and SIGUSR1 where they
    still have their default action (a user's or another library's own
    handler stands), so that a preemption before the training loop never
    leaves a killed process."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _early)


def _ignore_usr1_at_exit() -> None:
    """From here on the process is leaving anyway. Python's finalization puts
    SIG_DFL back for every signal with a Python handler, so a batch system's
    SIGUSR1 landing in that last window would kill a process whose training
    had completed (the Slurm job then ends FAILED). Ours become SIG_IGN, which
    finalization keeps; a user's own handler is left alone."""
    current = signal.getsignal(signal.SIGUSR1)
    if current is _outside or isinstance(getattr(current, "__self__", None), StopSignals):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


class StopSignals:
    """Handlers for `signals`: they only note the first signal (`received`);
    the checkpoint is written on the training thread at the next step
    boundary, never inside a handler. Installed from the main thread only
    (Python delivers signals there). A signal arriving while not active
    (after `restore`, or when another library put our handler back) goes to
    the handler we replaced, so the process behaves as if we were never
    there."""

    def __init__(self, catch_sigint: bool) -> None:
        self.catch_sigint = catch_sigint
        self.received: int | None = None
        self.active = False
        self.replaced: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Handlers belong to this process: a pickled copy starts uninstalled.
        return {"catch_sigint": self.catch_sigint, "received": None, "active": False, "replaced": {}}

    def handler(self, signum: int, frame: Any) -> None:
        if self.active:
            if self.received is None:
                self.received = signum
            return
        prev = self.replaced.get(signum, signal.SIG_DFL)
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_DFL and threading.current_thread() is threading.main_thread():
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def install(self) -> None:
        """Install (again, if another library replaced ours); keeps `received`."""
        self.active = True
        _started[:] = [True]
        if threading.current_thread() is not threading.main_thread():
            return
        if _noted_outside and self.received is None:
            self.received = _noted_outside[0]
        _noted_outside.clear()
        for sig in signals(self.catch_sigint):
            current = signal.getsignal(sig)
            if current == self.handler:
                continue
            self.replaced.setdefault(sig, current)
            signal.signal(sig, self.handler)

    def restore(self) -> None:
        """Put back the handlers `install` replaced (where ours is still installed)."""
        self.active = False
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.replaced:
            if signal.getsignal(sig) == self.handler:
                signal.signal(sig, self.put_back(sig))

    def put_back(self, sig: int) -> Any:
        """The handler `restore` puts back for `sig`: the one replaced, except
        that a default SIGUSR1 becomes `_outside` (noted, not fatal)."""
        prev = self.replaced.get(sig)
        if prev in (signal.SIG_DFL, None) or prev is _early:
            return _outside if sig == signal.SIGUSR1 else prev or signal.SIG_DFL
        return prev


if threading.current_thread() is threading.main_thread():
    atexit.register(_ignore_usr1_at_exit)


def exit_code(explicit: int | None = None) -> int:
    """``explicit``, else HTCondor's CheckpointExitCode from the job ad, else
    ``$HINDSIGHT_EXIT_CODE``, else 85 (the engine's rule, shared with
    ``hindsight run``)."""
    return _native.checkpoint_exit_code(explicit)


def requeue_default() -> bool:
    return _settings.flag(_settings.SLURM_REQUEUE, False)


def leave(
    signum: int | None,
    checkpointed: str,
    code: int | None,
    *,
    requeue: bool,
    announce: bool = True,
    fresh: bool = True,
) -> NoReturn:
    """The end of the stop sequence, once the checkpoint is durable: requeue
    the Slurm job if asked, say what happened, exit with the checkpoint code.
    ``fresh``: a checkpoint was taken for this stop (else the rerun repeats
    the work since ``checkpointed``'s last one)."""
    code = exit_code(code)
    job = os.environ.get("SLURM_JOB_ID")
    requeue = bool(requeue and job)
    # Said before `scontrol requeue`: Slurm may kill the job's processes as
    # soon as it requeues it, and the line must reach the job's log.
    if announce:
        name = signal.Signals(signum).name if signum is not None else "signal"
        then = f"requeueing Slurm job {job} and exiting" if requeue else "exiting"
        done = (
            f"checkpointed {checkpointed}"
            if fresh
            else f"no checkpoint inside this iteration of {checkpointed} (its start was not kept: a rerun repeats it "
            "from the last checkpoint)"
        )
        print(f"hindsight: {name}: {done}; {then} with {code} to be rescheduled", file=sys.stderr, flush=True)
    if requeue:
        try:
            subprocess.run(["scontrol", "requeue", str(job)], timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"hindsight: scontrol requeue failed: {e}", file=sys.stderr)
    raise SystemExit(code)

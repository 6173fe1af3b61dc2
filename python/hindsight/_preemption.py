"""Preemption, shared by `hs.checkpointing` and the Lightning callback: which
signals mean "checkpoint and leave", the exit code the batch system expects,
the Slurm requeue, and the stop-then-exit sequence; plus the RNG state a
checkpoint must carry for an exact resume. One copy of each, so the two
front ends cannot drift."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

#: The exit code that tells a batch system "checkpointed, reschedule me".
DEFAULT_EXIT_CODE = 85


def signals(catch_sigint: bool) -> list[int]:
    """The signals that ask for a checkpoint and a clean exit."""
    sigs: list[int] = [signal.SIGTERM, signal.SIGUSR1]
    if catch_sigint:
        sigs.append(signal.SIGINT)
    return sigs


def exit_code(explicit: int | None = None) -> int:
    """``explicit``, else HTCondor's CheckpointExitCode from the job ad, else
    ``$HINDSIGHT_EXIT_CODE``, else 85."""
    if explicit is not None:
        return explicit
    ad = os.environ.get("_CONDOR_JOB_AD")
    if ad:
        try:
            m = re.search(r"^\s*CheckpointExitCode\s*=\s*(\d+)", Path(ad).read_text(), re.MULTILINE)
            if m:
                return int(m.group(1))
        except OSError as e:
            print(f"hindsight: cannot read the HTCondor job ad {ad}: {e}", file=sys.stderr)
    return int(os.environ.get("HINDSIGHT_EXIT_CODE", DEFAULT_EXIT_CODE))


def requeue_default() -> bool:
    return os.environ.get("HINDSIGHT_SLURM_REQUEUE") == "1"


def leave(signum: int | None, checkpointed: str, code: int | None, *, requeue: bool, announce: bool = True) -> NoReturn:
    """The end of the stop sequence, once the checkpoint is durable: requeue
    the Slurm job if asked, say what happened, exit with the checkpoint code."""
    code = exit_code(code)
    job = os.environ.get("SLURM_JOB_ID")
    if requeue and job:
        try:
            subprocess.run(["scontrol", "requeue", job], timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"hindsight: scontrol requeue failed: {e}", file=sys.stderr)
    if announce:
        name = signal.Signals(signum).name if signum is not None else "signal"
        print(
            f"hindsight: {name}: checkpointed {checkpointed}; exiting with {code} to be rescheduled",
            file=sys.stderr,
            flush=True,
        )
    raise SystemExit(code)


def rng_state() -> dict[str, Any]:
    """Python's, NumPy's (if imported), torch's and CUDA's (if initialized) RNG states."""
    state: dict[str, Any] = {"python": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Apply what `rng_state` captured (also after a round trip that turned tuples into lists)."""
    if "python" in state:
        v = state["python"]
        random.setstate((v[0], tuple(v[1]), v[2]))
    if "numpy" in state:
        import numpy as np

        np.random.set_state(tuple(state["numpy"]))
    if "torch" in state:
        import torch

        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state["cuda"]))

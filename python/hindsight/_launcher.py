"""What a rank of ``python -m hindsight.torchrun`` does at ``import
hindsight`` (a module of its own: importing ``hindsight.torchrun`` from the
package would run that module twice under ``-m``)."""

from __future__ import annotations

import os
import signal
import sys

from hindsight import _settings


def tie_rank_to_launcher() -> None:
    """In a rank of `python -m hindsight.torchrun`: die with it. A supervisor kills a hung
    job's process group, which the ranks (sessions of their own) are not
    in: without this they would outlive it, holding their ports and
    devices (Linux's parent-death signal; elsewhere nothing)."""
    at = os.environ.get(_settings.PIPES_AT)
    if not at or not sys.platform.startswith("linux") or at == str(os.getpid()):
        return
    if str(os.getppid()) != at:
        return  # not this launcher's own rank (a process the rank started)
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if str(os.getppid()) != at:  # the launcher died before the call took effect
        os._exit(128 + signal.SIGKILL)

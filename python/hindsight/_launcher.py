"""What a rank does at ``import hindsight`` and at its exit (a module of its
own: importing ``hindsight.torchrun`` from the package would run that
module twice under ``-m``)."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time

from hindsight import _settings


def tie_rank_to_launcher() -> None:
    """In a rank of `python -m hindsight.torchrun`: die with it. A supervisor kills a hung
    job's process group, which the ranks (sessions of their own) are not
    in: without this they would outlive it, holding their ports and
    devices (Linux's parent-death signal; elsewhere nothing)."""
    at = _settings.text(_settings.PIPES_AT)
    if not at or not sys.platform.startswith("linux") or at == str(os.getpid()):
        return
    if str(os.getppid()) != at:
        return  # not this launcher's own rank (a process the rank started)
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if str(os.getppid()) != at:  # the launcher died before the call took effect
        os._exit(128 + signal.SIGKILL)


# The thread name torch gives a gloo process group's workers (15 characters:
# the kernel's limit, so /proc shows it whole).
_GLOO_LOOP = "pt_gloo_runloop"


def proc_stat(path: str) -> tuple[str, list[str]] | None:
    """A `/proc/.../stat` file as (comm, the fields after it: state, ppid,
    ...); None where it is gone. comm may hold spaces and parentheses, never
    the last ")"."""
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:
        return None
    end = stat.rfind(")")
    return stat[stat.find("(") + 1 : end], stat[end + 2 :].split()


def _gloo_loops_busy() -> bool | None:
    """Whether a gloo worker thread of this process is running or runnable;
    None where there is none (or no /proc)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    busy = None
    for tid in tids:
        stat = proc_stat(f"/proc/self/task/{tid}/stat")
        if stat is not None and stat[0] == _GLOO_LOOP:  # None: the thread ended
            busy = bool(busy) or stat[1][:1] in (["R"], ["D"])
    return busy


def settle_gloo_at_exit(budget: float = 0.5) -> None:
    """At exit (the last of hindsight's exit handlers): let gloo's worker
    threads finish before the interpreter shuts down. A worker frees each
    finished collective, and with it a Python object that every backward
    pass stashes in the collective's thread-local state (torch >= 2.11);
    freeing it takes the GIL, and a thread that asks for the GIL after
    finalization began is ended by Python with a forced unwind that
    aborts the process ("terminate called without an active exception",
    exit -6). A DDP rank whose worker thread was descheduled at that
    moment died after finishing its training, and torchrun reported the
    job failed. Sleeping hands over the GIL; this returns once no worker
    thread was running at two looks in a row, or after ``budget`` seconds
    (an exit never hangs here)."""
    if "torch.distributed" not in sys.modules or not sys.platform.startswith("linux"):
        return
    if _gloo_loops_busy() is None:
        return
    deadline = time.monotonic() + budget
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(0.002)
        quiet = 0 if _gloo_loops_busy() else quiet + 1


# Registered at `import hindsight`, before the store's flush at exit: exit
# handlers run last-registered first, so this one runs after the flush.
atexit.register(settle_gloo_at_exit)

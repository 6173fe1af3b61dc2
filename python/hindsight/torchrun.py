"""``python -m hindsight.torchrun ...``: ``torchrun`` (same arguments) whose
exit code tells a batch system that the job checkpointed.

When every rank of a job stops on a signal (``hindsight.dist.StopOnSignal``),
each exits with the checkpoint exit code (85, or the batch system's), but
``torchrun`` itself reports any non-zero exit of its workers as a failure
and exits 1, so a scheduler keyed on 85 would not requeue the job. This
launcher exits with the checkpoint code when every failed rank left with it,
with a replay's divergence code when a rank of a replay worker diverged,
and as ``torchrun`` does otherwise. It also keeps the pipes a supervisor or
a replay driver handed down within reach of the ranks, and makes torchrun's
own restarts meet the restarted peers.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from hindsight import _native, _preemption, _settings


def _children() -> list[int]:
    """The pids of this process's children (torchrun's ranks)."""
    me, found = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # pid (comm) state ppid ...: comm may hold spaces, not ")".
                ppid = f.read().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        if ppid == me:
            found.append(int(entry))
    return found


def _forward_stack_dumps() -> None:
    """SIGUSR2 (the supervisor's "hung: dump your stacks", before it kills
    the job) reaches the ranks too: torchrun starts them in sessions of
    their own, out of reach of a signal to this process group."""

    def forward(signum: int, frame: object) -> None:
        ranks = _children()
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGUSR2)
            except OSError:
                continue
            # One rank at a time: dumps written at once interleave on the
            # shared stderr; all within the supervisor's grace (3 s).
            time.sleep(min(0.5, 2.0 / len(ranks)))

    signal.signal(signal.SIGUSR2, forward)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # The ranks reopen the pipes this process inherited (the supervisor's
    # heartbeat, a replay worker's progress): torchrun closes them in its
    # workers (`_run.common.inherited_pipe`).
    os.environ[_settings.PIPES_AT] = str(os.getpid())
    # A restart (`--max-restarts`, an elastic re-rendezvous) must meet its
    # peers, not the previous attempt's: with the rendezvous store shared
    # with the workers' process group (torch's default since 2.5), a
    # restarted rank may read a dead peer's address left by the previous
    # attempt and fail to connect (pytorch/pytorch#135712; here 4 restarts
    # in 6 failed, none in 5 with the store kept apart). A user's own
    # setting stands.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    _forward_stack_dumps()
    try:
        torchrun(argv)
    except ChildFailedError as e:
        code = _preemption.exit_code()
        codes = {f.exitcode for f in e.failures.values()}
        if _native.EXIT_DIVERGED in codes:
            # A replay worker's rank found the replay diverging: the driver
            # reads that from the worker's status, whatever the others did.
            return int(_native.EXIT_DIVERGED)
        if codes == {code}:
            print(
                f"hindsight: every rank that stopped ({len(e.failures)}) exited with the checkpoint code {code}; "
                f"exiting with {code} to be rescheduled",
                file=sys.stderr,
                flush=True,
            )
            return code
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

A stop signal (SIGTERM, SIGUSR1, SIGINT) that reaches this launcher, alone
(``docker stop``, Kubernetes) or with the ranks (``scancel``, Slurm's
``--signal``, HTCondor's eviction), is passed on to every rank and never
reaches torchrun's own handler (which would raise, print a traceback and
exit 1; SIGUSR1 would kill the launcher): the ranks stop at one agreed step
and checkpoint, and this launcher exits 85, or 0 when the job had completed.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

from hindsight import _native, _preemption, _settings
from hindsight._launcher import proc_stat


def _children() -> list[int]:
    """The pids of this process's children (torchrun's ranks)."""
    me, found = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        stat = proc_stat(f"/proc/{entry}/stat") if entry.isdigit() else None
        if stat is not None and stat[1][1:2] == [me]:  # state, ppid, ...
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


#: The stop signals this launcher passes on to the ranks (see the module docs).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Those torch elastic may still handle itself (it reads the variable).
_TORCH_HANDLES = "SIGHUP,SIGQUIT"


class _Forwarder:
    """Passes each stop signal on to the ranks, and remembers the first."""

    def __init__(self) -> None:
        self.received: int | None = None

    def __call__(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
            print(
                f"hindsight: {signal.Signals(signum).name} reached the launcher: passed on to the ranks, which "
                "stop at one agreed step and checkpoint",
                file=sys.stderr,
                flush=True,
            )
        for pid in _children():
            try:
                os.kill(pid, signum)
            except OSError:
                continue

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self)


def _no_restart_to_leave(stop: _Forwarder) -> None:
    """torchrun's restarts (``--max-restarts``) are for ranks that crashed,
    not for ranks that checkpointed to leave: restarted, they would resume
    and train on until the batch system kills the job. Once a stop signal
    reached this launcher, or every rank that ended left with the
    checkpoint code, the worker group is stopped instead (the way torch's
    agent itself disables restarts for a wedged worker), and this launcher
    exits with the checkpoint code."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    code = _preemption.exit_code()
    monitor = LocalElasticAgent._monitor_workers

    def _monitor_workers(self: Any, worker_group: Any) -> Any:
        result = monitor(self, worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            codes = {f.exitcode for f in (result.failures or {}).values()}
            if stop.received is not None or codes == {code}:
                self._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = _monitor_workers  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    stop = _Forwarder()
    stop.install()
    _no_restart_to_leave(stop)
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a.split("=")[0] in ("--signals-to-handle", "--signals_to_handle") for a in args):
        # torch elastic installs its handlers for these only (a user's own choice stands).
        args = ["--signals-to-handle", _TORCH_HANDLES, *args]

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
    # SIGINT to a job is a stop request like SIGTERM (a container's stop
    # signal, Ctrl-C on the launcher): the ranks checkpoint on it, where
    # one interactive process leaves it a KeyboardInterrupt. A user's own
    # setting stands.
    os.environ.setdefault(_settings.CATCH_SIGINT, "1")
    _forward_stack_dumps()
    try:
        torchrun(args)
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
        if stop.received is not None and codes <= {code, -stop.received, 128 + stop.received}:
            # Ranks the stop signal ended before they could checkpoint (it
            # came before hindsight's handlers were in place): a rerun
            # resumes from the last checkpoint, as after a checkpoint.
            print(
                f"hindsight: {signal.Signals(stop.received).name} ended ranks before they checkpointed (exit codes "
                f"{sorted(codes)}); exiting with {code} to be rescheduled: a rerun resumes from the last checkpoint",
                file=sys.stderr,
                flush=True,
            )
            return code
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())

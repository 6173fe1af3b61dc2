"""``python -m hindsight.torchrun ...``: ``torchrun`` (same arguments) whose
exit code tells a batch system that the job checkpointed.

When every rank of a job stops on a signal (``hindsight.dist.StopOnSignal``),
each exits with the checkpoint exit code (85, or the batch system's), but
``torchrun`` itself reports any non-zero exit of its workers as a failure
and exits 1, so a scheduler keyed on 85 would not requeue the job. This
launcher exits with the checkpoint code when every failed rank left with it,
with a replay's divergence code when a rank of a replay worker diverged,
and as ``torchrun`` does otherwise. It also keeps the pipes a supervisor or
a replay driver handed down within reach of the ranks.
"""

from __future__ import annotations

import os
import sys

from hindsight import _native, _preemption, _settings


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # The ranks reopen the pipes this process inherited (the supervisor's
    # heartbeat, a replay worker's progress): torchrun closes them in its
    # workers (`_run.common.inherited_pipe`).
    os.environ[_settings.PIPES_AT] = str(os.getpid())
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

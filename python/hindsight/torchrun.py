"""``python -m hindsight.torchrun ...``: ``torchrun`` (same arguments) whose
exit code tells a batch system that the job checkpointed.

When every rank of a job stops on a signal (``hindsight.dist.StopOnSignal``),
each exits with the checkpoint exit code (85, or the batch system's), but
``torchrun`` itself reports any non-zero exit of its workers as a failure
and exits 1, so a scheduler keyed on 85 would not requeue the job. This
launcher exits with the checkpoint code when every failed rank left with it,
and as ``torchrun`` does otherwise.
"""

from __future__ import annotations

import sys

from hindsight import _preemption


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except ChildFailedError as e:
        code = _preemption.exit_code()
        codes = {f.exitcode for f in e.failures.values()}
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

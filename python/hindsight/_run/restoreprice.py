"""What restoring a checkpoint costs, measured once per recording process,
off the training thread: the first durable checkpoint is read back and
verified (the GIL released), and the session spaces adaptive checkpoints by
it (core `AdaptivePolicy::pays_back`). Its CPU is background work of the
recording, like the writer's hashing."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from hindsight.errors import HindsightError


class RestorePrice:
    """The timed read-back: the thread, then its result, then its CPU."""

    def __init__(self) -> None:
        self.probe: threading.Thread | None = None
        self.read: list[float] = []
        # What it took from the training (all of it on a CPU job, nothing
        # beside a GPU job's idle cores): its wall time bounds its CPU.
        self.cpu = 0.0

    def poll(self, first: Any, store: Any) -> float | None:
        """Start the read-back of `first` (a save handle) once it is
        durable; the seconds it took, once, when it is over."""
        if self.probe is None:
            if first is None or store is None or not first.done():
                return None
            name = first.name

            def read_back() -> None:
                t0 = time.perf_counter()
                try:
                    problems = store.verify([name])
                except HindsightError:
                    return  # retention or gc took it first: unpriced, as before
                if not problems:
                    self.read.append(time.perf_counter() - t0)
                elif name in store.list():
                    # Still there, and it did not read back: said, not swallowed.
                    print(
                        f"hindsight: checkpoint {name} did not read back intact: {'; '.join(problems)}",
                        file=sys.stderr,
                        flush=True,
                    )

            # Not a daemon: one read of one checkpoint, which exit waits for
            # rather than stopping it inside the engine.
            self.probe = threading.Thread(target=read_back, name="hindsight-restore-price")
            self.probe.start()
            return None
        if self.read and not self.probe.is_alive():
            secs = self.read.pop()
            self.cpu += secs
            return secs
        return None

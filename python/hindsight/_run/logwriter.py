"""The log database's writes, in order, off the training thread.

A run buffers what it logs (`add`) and the rows it keeps beside (an
iteration's timing, a step's batch fingerprint: `submit`). The writes go to
one background thread, which runs them in the order they were made; the
database call releases the GIL.

The thread is woken in batches, not per write. Waking it once per iteration
cost a loop of 5 ms iterations about 5% of its training thread on a 2-core
machine: a cross-CPU wake-up, and the two threads passing the GIL back and
forth. So pending writes are handed over at most every `HANDOFF_S` (`hand`),
and at once where the run needs them durable: a checkpoint, a signal, the
end (`flush`). What a kill -9 loses is what it always lost, the values of
the iterations after the last checkpoint, which a resume runs again.

A write's error is kept and raised by the next `check` or `flush`. The
thread's CPU time is counted (`cpu_seconds`): it is the recording's own
cost, which the adaptive policy charges to its budget.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

#: A logged value's row: (name, context [(loop, index)], occurrence, encoded value).
Row = tuple[str, list[tuple[str, int]], int, str]

#: Rows buffered before they are staged as one write.
LOG_BATCH = 1024
#: Pending writes are handed to the thread at most this often, unless forced.
HANDOFF_S = 0.1
#: ... or once this many are pending.
MAX_PENDING = 256


class LogWriter:
    """One run's buffered values and pending writes, and the thread that writes them."""

    def __init__(self, write_rows: Callable[[list[Row]], Any]) -> None:
        self.rows: list[Row] = []
        self._write_rows = write_rows
        self._pending: list[Callable[[], Any]] = []
        self._queue: queue.Queue[list[Callable[[], Any]] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._handed = time.monotonic()
        #: CPU seconds the thread has spent writing, a running total.
        self.cpu_seconds = 0.0
        self._thread: threading.Thread | None = threading.Thread(target=self._run, name="hindsight-logs", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            writes = self._queue.get()
            t0 = time.thread_time()
            try:
                if writes is None:
                    return
                for write in writes:
                    if self._error is None:
                        write()
            except BaseException as e:  # noqa: BLE001 - surfaced by the next check or flush
                self._error = e
            finally:
                self.cpu_seconds += time.thread_time() - t0
                self._queue.task_done()

    @property
    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def add(self, row: Row) -> None:
        self.rows.append(row)
        if len(self.rows) >= LOG_BATCH:
            self.check()
            self.stage()
            self.hand()

    def stage(self) -> None:
        """The buffered values become one pending write."""
        if self.rows:
            rows, self.rows = self.rows, []
            self._pending.append(functools.partial(self._write_rows, rows))

    def submit(self, write: Callable[[], Any]) -> None:
        """A write to run after those made before it."""
        self._pending.append(write)

    def hand(self, force: bool = False, stage: Callable[[], None] | None = None) -> None:
        """Give the pending writes to the thread if forced, or if due
        (`HANDOFF_S` since the last hand-over, or `MAX_PENDING` of them).
        ``stage`` first turns the caller's own buffers into pending writes,
        only then: rows buffered between hand-overs become one write each
        (one SQLite transaction), not one per iteration."""
        now = time.monotonic()
        if not force and now - self._handed < HANDOFF_S and len(self._pending) < MAX_PENDING:
            return
        if stage is not None:
            stage()
        if not self._pending:
            return
        writes, self._pending = self._pending, []
        self._handed = now
        if self._alive:
            self._queue.put(writes)
        else:  # after close: written here
            for write in writes:
                write()

    def check(self) -> None:
        """Raise the error a background write met, once."""
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def flush(self) -> None:
        """Everything added and submitted so far is written when this returns."""
        self.stage()
        self.hand(force=True)
        if self._alive:
            self._queue.join()
        self.check()

    def close(self) -> None:
        """Flush, then stop the thread; later writes run on the caller's thread."""
        try:
            self.flush()
        finally:
            thread, self._thread = self._thread, None
            if thread is not None and thread.is_alive():
                self._queue.put(None)
                thread.join()

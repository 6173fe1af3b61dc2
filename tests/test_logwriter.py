"""The log writer: a run's values and rows reach the database in the order
they were made, durable at every flush, with a background write's error
raised on the training thread, never lost."""

from __future__ import annotations

import threading

import pytest

from hindsight._run import logwriter
from hindsight._run.logwriter import LogWriter, Row


def test_writes_land_in_order_and_are_all_there_after_a_flush() -> None:
    landed: list[object] = []
    w = LogWriter(lambda rows: landed.append(("rows", [r[0] for r in rows])))
    for i in range(5):
        w.add((f"v{i}", [("epoch", i)], 0, "1"))
        w.stage()
        w.submit(lambda i=i: landed.append(("iteration", i)))
        w.hand()  # not yet due: kept for the next hand-over
    w.flush()
    assert landed == [x for i in range(5) for x in (("rows", [f"v{i}"]), ("iteration", i))]
    w.close()


def test_a_loop_of_fast_iterations_wakes_the_thread_in_batches_not_per_iteration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handed: list[int] = []
    w = LogWriter(lambda rows: None)
    put = w._queue.put
    monkeypatch.setattr(
        w._queue, "put", lambda writes: (handed.append(0 if writes is None else len(writes)), put(writes))
    )
    for _ in range(100):
        w.submit(lambda: None)
        w.hand()
    w.flush()
    # Within HANDOFF_S of each other, 100 iterations are one or two hand-overs.
    assert 1 <= len(handed) <= 2 and sum(handed) == 100, handed
    w.close()


def test_a_forced_hand_over_reaches_the_thread_at_once() -> None:
    wrote = threading.Event()
    w = LogWriter(lambda rows: None)
    w.submit(wrote.set)
    w.hand(force=True)  # a row naming a checkpoint
    assert wrote.wait(10)
    w.close()


def test_a_background_error_is_raised_by_the_next_flush_and_later_writes_still_run_after_it() -> None:
    landed: list[int] = []
    w = LogWriter(lambda rows: None)

    def broken() -> None:
        raise OSError("disk full: logs.db")

    w.submit(broken)
    with pytest.raises(OSError, match="disk full"):
        w.flush()
    w.submit(lambda: landed.append(1))
    w.flush()  # raised once; the writer goes on
    assert landed == [1]
    w.close()


def test_after_close_writes_run_on_the_caller_and_the_thread_is_gone() -> None:
    landed: list[str] = []
    w = LogWriter(lambda rows: landed.extend(r[0] for r in rows))
    w.add(("a", [], 0, "1"))
    w.close()
    assert landed == ["a"]
    row: Row = ("b", [], 0, "2")
    w.add(row)
    w.flush()
    assert landed == ["a", "b"]
    assert not any(t.name == "hindsight-logs" and t.is_alive() for t in threading.enumerate() if t is w._thread)


def test_the_threads_cpu_is_counted_for_the_policy() -> None:
    w = LogWriter(lambda rows: None)
    w.submit(lambda: sum(range(300_000)))
    w.flush()
    assert w.cpu_seconds > 0
    w.close()


def test_a_batch_of_logged_values_is_staged_once_it_is_large() -> None:
    landed: list[int] = []
    w = LogWriter(lambda rows: landed.append(len(rows)))
    for i in range(logwriter.LOG_BATCH):
        w.add(("loss", [("step", i)], 0, "1"))
    w.flush()
    assert landed == [logwriter.LOG_BATCH]
    w.close()


def test_rows_buffered_between_hand_overs_become_one_write_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """`hand(stage=...)` stages the caller's buffers only when it hands
    over: a loop of fast iterations writes its values and its iteration rows
    once per hand-over (one transaction each), in order, not once per
    iteration."""
    monkeypatch.setattr(logwriter, "HANDOFF_S", 3600.0)  # none due by time: only the forced one
    landed: list[object] = []
    pending: list[int] = []
    w = LogWriter(lambda rows: landed.append(("rows", [r[0] for r in rows])))

    def stage() -> None:
        w.stage()
        if pending:
            done, pending[:] = list(pending), []
            w.submit(lambda: landed.append(("iterations", done)))

    for i in range(20):
        w.add((f"v{i}", [("iter", i)], 0, "1"))
        pending.append(i)
        w.hand(stage=stage)  # not yet due
    assert landed == []
    w.hand(force=True, stage=stage)  # a row naming a checkpoint: at once
    w.flush()
    assert landed == [("rows", [f"v{i}" for i in range(20)]), ("iterations", list(range(20)))]
    w.close()

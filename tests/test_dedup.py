"""Unchanged data costs nothing: chunk dedup and unchanged-tensor skipping."""

from __future__ import annotations

import threading
import time

import torch

import hindsight as hs


def chunk_bytes(store: hs.Store) -> int:
    u = store.usage()
    return u["stored_bytes"]


def test_saving_same_state_twice_adds_no_chunk_bytes(store_dir):
    state = {"w": torch.randn(512, 1024), "b": torch.randn(1024)}
    store = hs.Store(store_dir)
    store.save("a", state).wait()
    before = store.usage()
    # A fresh store object has no unchanged-tensor cache: dedup must come from content hashes.
    store2 = hs.Store(store_dir)
    stats = store2.save("b", state).wait()
    after = store2.usage()
    assert stats["chunks_written"] == 0 and stats["chunks_deduplicated"] > 0
    assert after["unique_bytes"] == before["unique_bytes"]
    assert after["logical_bytes"] == 2 * before["logical_bytes"]
    # Only the second manifest was added.
    assert after["stored_bytes"] - before["stored_bytes"] < 4096


def test_frozen_half_adds_only_the_other_half(store_dir):
    torch.manual_seed(0)
    frozen = {f"frozen.{i}": torch.randn(256, 1024) for i in range(4)}  # 4 MiB
    live = {f"live.{i}": torch.randn(256, 1024) for i in range(4)}  # 4 MiB
    store = hs.Store(store_dir)
    store.save("e0", {**frozen, **live}).wait()
    base = chunk_bytes(store)
    live_bytes = sum(t.numel() * t.element_size() for t in live.values())
    for epoch in range(1, 4):
        for t in live.values():
            t.add_(0.01)
        stats = store.save(f"e{epoch}", {**frozen, **live}).wait()
        # Frozen tensors were neither copied nor written.
        assert stats["bytes_reused"] == sum(t.numel() * 4 for t in frozen.values())
        assert stats["bytes_staged"] == live_bytes
    growth = chunk_bytes(store) - base
    assert live_bytes * 3 <= growth < live_bytes * 3 * 1.01
    for epoch in range(4):
        got = store.load(f"e{epoch}")
        assert torch.equal(got["frozen.0"], frozen["frozen.0"])
    assert torch.equal(store.load("e3")["live.2"], live["live.2"])


def test_write_through_dot_data_is_not_missed(store_dir):
    # `.data` writes bypass the version counter; the full-content fingerprint catches them.
    p = torch.nn.Parameter(torch.zeros(64, 1024))
    store = hs.Store(store_dir)
    store.save("a", {"p": p}).wait()
    p.data.add_(1.0)
    stats = store.save("b", {"p": p}).wait()
    assert stats["bytes_reused"] == 0
    assert torch.equal(store.load("b")["p"], torch.ones(64, 1024))
    assert torch.equal(store.load("a")["p"], torch.zeros(64, 1024))


def test_snapshot_is_consistent_when_caller_mutates_after_save(store_dir):
    t = torch.zeros(4 << 20)  # 16 MiB, several chunks
    store = hs.Store(store_dir)
    h = store.save("snap", {"t": t})
    t.fill_(7.0)  # the caller may change its tensor as soon as save returns
    h.wait()
    assert torch.equal(store.load("snap")["t"], torch.zeros(4 << 20))


def test_staging_budget_bounds_memory(store_dir):
    budget = 8 << 20
    store = hs.Store(store_dir, staging_bytes=budget, chunk_size=1 << 20)
    state = {f"t{i}": torch.randn(2 << 20) for i in range(8)}  # 64 MiB, 8x the budget
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, store.staging_in_use())
            time.sleep(0.0005)

    th = threading.Thread(target=sample)
    th.start()
    try:
        h = store.save("big", state)
        h.wait()
    finally:
        stop.set()
        th.join()
    assert 0 < peak <= budget
    got = store.load("big")
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_compressed_store_round_trips_and_shrinks_compressible_data(tmp_path):
    zs = hs.Store(tmp_path / "z", compression="zstd")
    raw = hs.Store(tmp_path / "r")
    state = {"zeros": torch.zeros(1 << 20), "rand": torch.randn(1 << 16)}
    zs.save("c", state).wait()
    raw.save("c", state).wait()
    assert zs.usage()["stored_bytes"] < raw.usage()["stored_bytes"] / 2
    got = zs.load("c")
    assert torch.equal(got["zeros"], state["zeros"]) and torch.equal(got["rand"], state["rand"])
    # Options are fixed at creation; reopening with other options is refused.
    import pytest

    with pytest.raises(hs.InvalidArgumentError, match="fixed at creation"):
        hs.Store(tmp_path / "z", compression="none")
    assert hs.Store(tmp_path / "z").compression == "zstd"

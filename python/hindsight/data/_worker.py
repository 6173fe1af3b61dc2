"""A worker process: runs the user's dataset and collate function for the
units the Rust worker server is asked for. Before each example, Python's,
NumPy's and torch's global generators are seeded from (seed, epoch, index),
so unmodified random transforms draw the same numbers when a unit is
recomputed elsewhere after a failure."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hindsight import _native
from hindsight.data._codec import encode
from hindsight.data._spec import canonical_args, code_version, is_sharded
from hindsight.errors import HindsightError

_current_seed: int | None = None


def current_example_seed() -> int:
    """The seed of the example being produced (inside a dataset's ``__getitem__``)."""
    if _current_seed is None:
        raise RuntimeError("hindsight.data.current_example_seed() is only set while a worker produces an example")
    return _current_seed


def example_generator(device: str = "cpu") -> torch.Generator:
    """A torch generator seeded for the example being produced, for transforms that take one."""
    g = torch.Generator(device=device)
    g.manual_seed(current_example_seed())
    return g


def _seed_all(seed: int) -> None:
    global _current_seed
    _current_seed = seed
    random.seed(seed)
    np.random.seed(seed & 0xFFFF_FFFF)
    # torch.manual_seed also seeds (and records stacks for) lazy CUDA init:
    # ~0.2 ms per example. The CPU generator is what workers draw from.
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.manual_seed_all(seed)


_MISSING = object()


class ShardReader:
    """Reads records of a sharded dataset sequentially. A unit's records are
    scattered over its split's contiguous runs: reading one record reads
    (and keeps) those before it in the same shard, which later units of the
    split need. Only a worker that starts mid-split (after a failover) or a
    record already passed reopens a shard.

    Its read state (positions, the readers' own ``state_dict()``, records
    read ahead) can be snapshot and restored: the worker checkpoints."""

    def __init__(self, ds: Any, keep: int = 1 << 16):
        self.ds, self.keep = ds, keep
        self.cursors: dict[int, list[Any]] = {}  # shard -> [iterator, next offset]
        self.ahead: dict[tuple[int, int], Any] = {}
        self.opens = 0
        self.records_read = 0
        self.read_seconds = 0.0

    def get(self, shard: int, offset: int) -> Any:
        rec = self.ahead.pop((shard, offset), _MISSING)
        if rec is not _MISSING:
            return rec
        t0 = time.perf_counter()
        cur = self.cursors.get(shard)
        if cur is None or cur[1] > offset:
            cur = [iter(self.ds.open(shard, offset)), offset]
            self.cursors[shard] = cur
            self.opens += 1
        n = offset - cur[1] + 1
        while cur[1] < offset:
            self.ahead[(shard, cur[1])] = next(cur[0])
            cur[1] += 1
        rec = next(cur[0])
        cur[1] += 1
        self.records_read += n
        self.read_seconds += time.perf_counter() - t0
        while len(self.ahead) > self.keep:  # abandoned splits: forget the oldest
            del self.ahead[next(iter(self.ahead))]
        return rec

    def kept(self, shards: set[int]) -> int:
        return sum(1 for s, _ in self.ahead if s in shards)

    def snapshot(self, shards: set[int]) -> dict[str, Any]:
        """The read state of ``shards``: a tree a hindsight store holds."""
        cursors = []
        for shard in sorted(shards):
            cur = self.cursors.get(shard)
            if cur is not None:
                state_dict = getattr(cur[0], "state_dict", None)
                cursors.append(
                    {"shard": shard, "next": cur[1], "state": state_dict() if callable(state_dict) else None}
                )
        keys = [k for k in self.ahead if k[0] in shards]
        return {
            "cursors": cursors,
            "ahead_keys": [list(k) for k in keys],
            "ahead": [self.ahead[k] for k in keys],
        }

    def restore(self, snap: dict[str, Any]) -> None:
        """Continue from a snapshot: readers resume from their own state
        (``ds.resume(shard, state)``) when they have one, else reopen."""
        resume = getattr(self.ds, "resume", None)
        for c in snap["cursors"]:
            shard, nxt, state = int(c["shard"]), int(c["next"]), c["state"]
            it = resume(shard, state) if state is not None and callable(resume) else self.ds.open(shard, nxt)
            self.cursors[shard] = [iter(it), nxt]
            self.opens += 1
        for (shard, offset), rec in zip(snap["ahead_keys"], snap["ahead"], strict=True):
            self.ahead[(int(shard), int(offset))] = rec


class _SplitProgress:
    def __init__(self, next_batch: int, read_before: int):
        self.next_batch = next_batch
        self.read_before = read_before  # reader.records_read when this split started here
        self.restored_read = 0  # records an earlier worker read for it (restored)
        self.shards: set[int] = set()
        self.since = 0
        self.names: list[str] = []


class WorkerCheckpoints:
    """Worker checkpoints of sharded splits (seed 002): at unit boundaries,
    when ``CheckpointPolicy`` (``hindsight_data::recovery``) says one pays,
    the split's read state goes into a hindsight store; a worker that takes
    over the split mid-way restores the latest one instead of reading the
    split again. Saves are asynchronous: the stall is the snapshot only."""

    def __init__(self, path: str, max_overhead: float):
        self.path = path
        self.policy = _native.CheckpointPolicy(max_overhead)
        self._store: Any = None
        self.splits: dict[tuple[int, int], _SplitProgress] = {}
        self.taken = self.restored = 0

    def store(self) -> Any:
        if self._store is None:
            from hindsight._store import Store

            self._store = Store(self.path)
        return self._store

    def begin(self, work: _native.UnitWork, reader: ShardReader) -> _SplitProgress:
        key = (work.epoch, work.split)
        prog = self.splits.get(key)
        if prog is not None and prog.next_batch == work.batch:
            return prog
        prog = _SplitProgress(work.batch, reader.records_read)
        self.splits[key] = prog
        if work.batch > work.split_start and not self.policy.gave_up:
            name = _native.data_latest_checkpoint(self.store().list(), work.job_id, work.epoch, work.split, work.batch)
            if name is not None:
                try:
                    snap = self.store().load(name)
                except HindsightError as e:  # recompute instead; say why
                    print(f"hindsight data worker: worker checkpoint {name} not restored: {e}", file=sys.stderr)
                else:
                    reader.restore(snap)
                    prog.restored_read = int(snap.get("read", 0))
                    prog.names.append(name)
                    self.restored += 1
        return prog

    def end(self, work: _native.UnitWork, reader: ShardReader, prog: _SplitProgress, unit_s: float) -> None:
        self.policy.observe_unit(unit_s)
        prog.next_batch = work.batch + 1
        prog.since += 1
        prog.shards.update(work.shards)
        if prog.next_batch >= work.split_end:
            del self.splits[(work.epoch, work.split)]
            self._remove(prog.names)
            return
        read = prog.restored_read + reader.records_read - prog.read_before
        kept = reader.kept(prog.shards)
        if self.policy.decide(read, kept, prog.since) != "checkpoint":
            return
        name = _native.data_checkpoint_name(work.job_id, work.epoch, work.split, prog.next_batch)
        try:
            store = self.store()  # opened outside the timing: one-time set-up is not a stall
            t0 = time.perf_counter()
            store.save(name, {**reader.snapshot(prog.shards), "read": read}, skip_unchanged=False)
        except HindsightError as e:  # unstorable records, a full disk: recompute instead
            print(f"hindsight data worker: no more worker checkpoints: {e}", file=sys.stderr)
            self.policy = _native.CheckpointPolicy(0.0)
            return
        stall = time.perf_counter() - t0 - store.last_setup_seconds
        self.policy.observe_checkpoint(kept, max(0.0, stall))
        prog.since = 0
        prog.names.append(name)
        self.taken += 1

    def _remove(self, names: list[str]) -> None:
        """A finished split's checkpoints go. On this thread: a helper thread
        calling into the store could be torn down mid-call at exit."""
        for name in names:
            with contextlib.suppress(HindsightError):
                self.store().remove(name)


def make_produce(
    factory: Callable[..., Any],
    args: dict[str, Any],
    collate_fn: Callable[[list[Any]], Any] | None,
    checkpoints: WorkerCheckpoints | None = None,
) -> Callable[[_native.UnitWork], memoryview]:
    """The function the worker server calls for each unit. The dataset is
    built on first use, so a factory that raises reaches the trainer as a
    pipeline error with its traceback. Records of a sharded dataset are
    read without randomness; each then goes through ``ds.transform`` (if
    any) after the example's seeding, so augmentation is reproducible."""
    collate = collate_fn or torch.utils.data.default_collate
    built: list[Any] = []

    def produce(work: _native.UnitWork) -> memoryview:
        if not built:
            ds = factory(**args)
            built.extend([ds, ShardReader(ds) if is_sharded(ds) else None])
        ds, reader = built
        items = []
        if work.shards:
            if reader is None:
                raise TypeError(f"{type(ds).__name__} has no shards()/open(): the job says the dataset is sharded")
            t0 = time.perf_counter()
            read0, read_s0 = reader.records_read, reader.read_seconds
            prog = checkpoints.begin(work, reader) if checkpoints is not None else None
            transform = getattr(ds, "transform", None)
            for shard, offset, seed in zip(work.shards, work.offsets, work.seeds, strict=True):
                record = reader.get(shard, offset)
                _seed_all(seed)
                items.append(transform(record) if transform is not None else record)
            out = encode(collate(items))
            if checkpoints is not None and prog is not None:
                checkpoints.policy.observe_read(reader.records_read - read0, reader.read_seconds - read_s0)
                checkpoints.end(work, reader, prog, time.perf_counter() - t0)
            return out
        for index, seed in zip(work.indices, work.seeds, strict=True):
            _seed_all(seed)
            items.append(ds[index])
        return encode(collate(items))

    return produce


def _raise_on_sigterm() -> None:
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)


def _import(spec: str, what: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise SystemExit(f"hindsight data worker: {what} must be module:name, got {spec!r}")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"hindsight data worker: cannot import {what} {spec!r}: {e}") from e
    return obj  # type: ignore[no-any-return]


def main(a: _native.WorkerArgs) -> int:
    """``hindsight data worker``: serve a dataset for a remote dispatcher
    (its arguments parsed by the command's one grammar,
    `hindsight_cli::pycmds::WorkerArgs`)."""
    try:
        args = json.loads(a.args)
    except json.JSONDecodeError as e:
        raise SystemExit(f"hindsight data worker: --args is not JSON: {e}") from e
    if not isinstance(args, dict):
        raise SystemExit("hindsight data worker: --args must be a JSON object")
    sys.path.insert(0, "")
    factory = _import(a.dataset, "--dataset")
    collate = _import(a.collate, "--collate") if a.collate else None
    torch.set_num_threads(1)
    _raise_on_sigterm()
    checkpoints = WorkerCheckpoints(a.checkpoints, a.checkpoint_overhead) if a.checkpoints else None

    def ready(address: str, worker_id: str) -> None:
        print(f"hindsight data worker {worker_id} serving {a.dataset} on {address}", flush=True)

    try:
        _native.serve_data_worker(
            a.dispatcher,
            a.dataset,
            canonical_args(args),
            code_version(factory, collate),
            make_produce(factory, args, collate, checkpoints),
            bind=a.bind,
            advertise=a.advertise,
            ready=ready,
            parent_pid=a.parent_pid,
            shared_dir=a.shared_dir,
        )
    except (KeyboardInterrupt, SystemExit):
        pass
    if a.shared_dir and a.parent_pid is not None and os.getppid() != a.parent_pid:
        # The trainer died without closing its loader: units in flight
        # would otherwise stay in shared memory.
        shutil.rmtree(a.shared_dir, ignore_errors=True)
    return 0

"""A worker process: runs the user's dataset and collate function for the
units the Rust worker server is asked for. Before each example, Python's,
NumPy's and torch's global generators are seeded from (seed, epoch, index),
so unmodified random transforms draw the same numbers when a unit is
recomputed elsewhere after a failure."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from hindsight import _native
from hindsight.data._codec import encode

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


def is_sharded(ds: object) -> bool:
    """A sharded dataset: ``shards()`` (record counts) and ``open(shard, offset)``."""
    return callable(getattr(ds, "shards", None)) and callable(getattr(ds, "open", None))


_MISSING = object()


class ShardReader:
    """Reads records of a sharded dataset sequentially. A unit's records are
    scattered over its split's contiguous runs: reading one record reads
    (and keeps) those before it in the same shard, which later units of the
    split need. Only a worker that starts mid-split (after a failover) or a
    record already passed reopens a shard."""

    def __init__(self, ds: Any, keep: int = 1 << 16):
        self.ds, self.keep = ds, keep
        self.cursors: dict[int, list[Any]] = {}  # shard -> [iterator, next offset]
        self.ahead: dict[tuple[int, int], Any] = {}
        self.opens = 0

    def get(self, shard: int, offset: int) -> Any:
        rec = self.ahead.pop((shard, offset), _MISSING)
        if rec is not _MISSING:
            return rec
        cur = self.cursors.get(shard)
        if cur is None or cur[1] > offset:
            cur = [iter(self.ds.open(shard, offset)), offset]
            self.cursors[shard] = cur
            self.opens += 1
        while cur[1] < offset:
            self.ahead[(shard, cur[1])] = next(cur[0])
            cur[1] += 1
        rec = next(cur[0])
        cur[1] += 1
        while len(self.ahead) > self.keep:  # abandoned splits: forget the oldest
            del self.ahead[next(iter(self.ahead))]
        return rec


def make_produce(
    factory: Callable[..., Any], args: dict[str, Any], collate_fn: Callable[[list[Any]], Any] | None
) -> Callable[..., bytes]:
    """The function the worker server calls for each unit. The dataset is
    built on first use, so a factory that raises reaches the trainer as a
    pipeline error with its traceback. Records of a sharded dataset are
    read without randomness; each then goes through ``ds.transform`` (if
    any) after the example's seeding, so augmentation is reproducible."""
    collate = collate_fn or torch.utils.data.default_collate
    built: list[Any] = []

    def produce(
        epoch: int,
        batch: int,
        indices: list[int],
        seeds: list[int],
        shards: list[int] | None = None,
        offsets: list[int] | None = None,
    ) -> bytes:
        if not built:
            ds = factory(**args)
            built.extend([ds, ShardReader(ds) if is_sharded(ds) else None])
        ds, reader = built
        items = []
        if shards is not None and offsets is not None:
            if reader is None:
                raise TypeError(f"{type(ds).__name__} has no shards()/open(): the job says the dataset is sharded")
            transform = getattr(ds, "transform", None)
            for shard, offset, seed in zip(shards, offsets, seeds, strict=True):
                record = reader.get(shard, offset)
                _seed_all(seed)
                items.append(transform(record) if transform is not None else record)
        else:
            for index, seed in zip(indices, seeds, strict=True):
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


def main(argv: Sequence[str] | None = None) -> int:
    """``hindsight data worker``: serve a dataset for a remote dispatcher."""
    from hindsight.data._loader import code_version

    p = argparse.ArgumentParser(prog="hindsight data worker", description=main.__doc__)
    p.add_argument("--dispatcher", required=True, help="host:port of the dispatcher")
    p.add_argument("--dataset", required=True, help="module:factory returning a map-style dataset")
    p.add_argument("--args", default="{}", help="JSON keyword arguments of the factory")
    p.add_argument("--collate", default=None, help="module:function (default: torch's default_collate)")
    p.add_argument("--bind", default="0.0.0.0:0", help="where to listen (default: any port)")
    p.add_argument(
        "--advertise",
        default=None,
        help="host[:port] clients use to reach this worker (port 0 or none: the bound port)",
    )
    p.add_argument("--parent-pid", type=int, default=None, help="stop when this process is gone (local workers)")
    p.add_argument(
        "--shared-dir",
        default=None,
        help="hand large units over through files in this shared-memory directory (workers on the client's host)",
    )
    a = p.parse_args(argv)
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

    def ready(address: str, worker_id: str) -> None:
        print(f"hindsight data worker {worker_id} serving {a.dataset} on {address}", flush=True)

    try:
        _native.serve_data_worker(
            a.dispatcher,
            a.dataset,
            code_version(factory, collate),
            make_produce(factory, args, collate),
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

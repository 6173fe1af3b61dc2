"""Datasets for the input-service tests and benchmark. Each example is a
float64 tensor of its index and the random draws (Python, NumPy, torch)
made while producing it, so a test sees at once whether an example was
delivered twice, skipped, or drawn with other randomness."""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import torch


class Draws(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(
        self, n: int, sleep_ms: float, fail_at: int | None, hang_at: int | None = None, crash_at: int | None = None
    ):
        self.n, self.sleep, self.fail_at, self.hang_at, self.crash_at = n, sleep_ms / 1000, fail_at, hang_at, crash_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.fail_at:
            raise ValueError(f"example {i} is broken")
        if i == self.hang_at:
            time.sleep(3600)  # never returns (the worker process is killed at close)
        if i == self.crash_at:
            import ctypes

            ctypes.string_at(0)  # a segmentation fault: the worker process dies
        if self.sleep:
            time.sleep(self.sleep)
        return torch.tensor(
            [float(i), random.random(), float(np.random.rand()), float(torch.rand(()))], dtype=torch.float64
        )


def make(
    n: int = 200,
    sleep_ms: float = 0.0,
    fail_at: int | None = None,
    hang_at: int | None = None,
    crash_at: int | None = None,
) -> Draws:
    return Draws(n, sleep_ms, fail_at, hang_at, crash_at)


def expected(spec: object, epoch: int, rank: int = 0, world: int = 1) -> list[torch.Tensor]:
    """What an epoch of ``make`` must deliver, computed without any worker:
    the core's order, and each example's draws from its derived seed."""
    from hindsight import _native

    assert isinstance(spec, _native.JobSpec)
    ds = make(spec.length)
    out = []
    for b in range(spec.batches_per_epoch()):
        rows = []
        for i in spec.batch_indices(epoch, b, rank, world):
            s = _native.data_example_seed(spec.seed, epoch, i)
            random.seed(s)
            np.random.seed(s & 0xFFFF_FFFF)
            torch.manual_seed(s)
            rows.append(ds[i])
        out.append(torch.stack(rows))
    return out


def audit(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[int, int]:
    """(duplicates, missing) of the delivered examples against the expected ones."""
    seen = [int(i) for b in got for i in b[:, 0]]
    dup = len(seen) - len(set(seen))
    missing = len({int(i) for b in want for i in b[:, 0]} - set(seen))
    return dup, missing


def broken(n: int = 10) -> Draws:
    raise RuntimeError("this dataset cannot be built here")


class Augmented(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """A CPU-bound augmentation pipeline (for the throughput benchmark)."""

    def __init__(self, n: int, size: int):
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        img = torch.rand(3, self.size, self.size, generator=g)
        # Random crop, flip and blur: work whose randomness comes from the
        # global generators, as torchvision transforms draw it.
        dx, dy = random.randrange(8), random.randrange(8)
        img = img[:, dy : dy + self.size - 8, dx : dx + self.size - 8]
        if torch.rand(()) < 0.5:
            img = img.flip(2)
        k = torch.ones(3, 1, 5, 5) / 25
        img = torch.nn.functional.conv2d(img[None], k, padding=2, groups=3)[0]
        return img, i % 10


def augmented(n: int = 2048, size: int = 96) -> Augmented:
    return Augmented(n, size)


class Records:
    """A sharded dataset: shards of records read in order, like files of a
    web dataset. Each record is (shard, offset); ``transform`` adds the
    example's random draws. Every ``open`` is appended to ``open_log``."""

    def __init__(self, counts: list[int], open_log: str | None):
        self.counts, self.open_log = counts, open_log

    def shards(self) -> list[int]:
        return self.counts

    def open(self, shard: int, offset: int):  # type: ignore[no-untyped-def]
        if self.open_log:
            with open(self.open_log, "a") as f:
                f.write(f"{shard} {offset}\n")
        for o in range(offset, self.counts[shard]):
            yield (shard, o)

    def transform(self, record: tuple[int, int]) -> torch.Tensor:
        shard, offset = record
        return torch.tensor(
            [float(shard), float(offset), random.random(), float(np.random.rand()), float(torch.rand(()))],
            dtype=torch.float64,
        )


def records(counts: list[int], open_log: str | None = None) -> Records:
    return Records(counts, open_log)


def expected_records(spec: object, epoch: int) -> list[torch.Tensor]:
    """What an epoch of ``records`` must deliver (one rank)."""
    import bisect

    from hindsight import _native

    assert isinstance(spec, _native.JobSpec)
    ds = Records(list(spec.shards), None)
    bases = [sum(spec.shards[:i]) for i in range(len(spec.shards))]
    out = []
    for b in range(spec.batches_per_epoch()):
        rows = []
        for i in spec.batch_indices(epoch, b, 0, 1):
            shard = bisect.bisect_right(bases, i) - 1
            while spec.shards[shard] == 0:
                shard -= 1
            s = _native.data_example_seed(spec.seed, epoch, i)
            random.seed(s)
            np.random.seed(s & 0xFFFF_FFFF)
            torch.manual_seed(s)
            rows.append(ds.transform((shard, i - bases[shard])))
        out.append(torch.stack(rows))
    return out


class _ScanReader:
    """A shard reader that cannot seek (a compressed stream, a packing
    iterator): its state is its position, and reading a record costs time."""

    def __init__(self, ds: Stream, shard: int, pos: int):
        self.ds, self.shard, self.pos = ds, shard, pos

    def __iter__(self) -> _ScanReader:
        return self

    def __next__(self) -> tuple[Any, ...]:
        if self.pos >= self.ds.counts[self.shard]:
            raise StopIteration
        if self.ds.read_s:
            time.sleep(self.ds.read_s)
        rec: tuple[Any, ...] = (self.shard, self.pos)
        if self.ds.record_bytes:
            rec += (bytes(self.ds.record_bytes),)  # a decoded record's payload
        self.pos += 1
        return rec

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}


class Stream(Records):
    """``Records`` whose shards are read from their start only, at a cost
    per record, with reader state (``state_dict`` / ``resume``) that worker
    checkpoints keep. ``open`` and ``resume`` calls go to ``open_log``."""

    def __init__(self, counts: list[int], open_log: str | None, read_ms: float, transform_ms: float, record_bytes: int):
        super().__init__(counts, open_log)
        self.read_s, self.transform_s, self.record_bytes = read_ms / 1000, transform_ms / 1000, record_bytes

    def _log(self, line: str) -> None:
        if self.open_log:
            with open(self.open_log, "a") as f:
                f.write(line + "\n")

    def open(self, shard: int, offset: int) -> _ScanReader:  # type: ignore[override]
        self._log(f"open {shard} {offset}")
        r = _ScanReader(self, shard, 0)
        for _ in range(offset):
            next(r)
        return r

    def resume(self, shard: int, state: dict[str, int]) -> _ScanReader:
        self._log(f"resume {shard} {state['pos']}")
        return _ScanReader(self, shard, int(state["pos"]))

    def transform(self, record: tuple[Any, ...]) -> torch.Tensor:  # type: ignore[override]
        time.sleep(self.transform_s)
        return super().transform((record[0], record[1]))


def stream(
    counts: list[int],
    open_log: str | None = None,
    read_ms: float = 3,
    transform_ms: float = 10,
    record_bytes: int = 0,
) -> Stream:
    return Stream(counts, open_log, read_ms, transform_ms, record_bytes)

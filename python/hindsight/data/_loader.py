"""``hs.data.Loader``: a DataLoader whose every example arrives exactly once
per epoch, in an order fixed by (seed, epoch), whatever happens to the
worker processes. The rules (order, identity, failover) are in the Rust
crate ``hindsight-data``; this module starts processes and converts data."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from hindsight import _native
from hindsight.data._codec import decode
from hindsight.data._spec import canonical_args, code_version, is_sharded
from hindsight.errors import DataMismatchError, HindsightError, InvalidArgumentError, NoDataWorkersError


def _name(factory: Callable[..., Any]) -> str:
    module = getattr(factory, "__module__", None) or "?"
    qual = getattr(factory, "__qualname__", None) or type(factory).__qualname__
    return f"{module}:{qual}"


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _LocalWorkers:
    """``local:N``: a dispatcher in this process and N worker processes,
    started the way remote ones are (``hindsight data worker``), never
    forked from the trainer. A worker that dies is replaced, so capacity
    recovers."""

    def __init__(self, n: int, dataset: str, args_json: str, collate: str | None, checkpoint_overhead: float):
        self._dir = tempfile.mkdtemp(prefix="hindsight-data-")
        # Batches are handed over through shared memory, as DataLoader's
        # are, when the host has it; otherwise they travel over loopback.
        self.shared_dir: str | None = None
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
            self.shared_dir = tempfile.mkdtemp(prefix="hindsight-data-", dir="/dev/shm")
        self.dispatcher = _native.DataDispatcher(self._dir)
        self.address = self.dispatcher.address
        self._cmd = [
            sys.executable, "-m", "hindsight", "data", "worker",
            "--dispatcher", self.address, "--dataset", dataset, "--args", args_json, "--bind", "127.0.0.1:0",
            "--parent-pid", str(os.getpid()),
            "--checkpoints", os.path.join(self._dir, "worker-checkpoints"),
            "--checkpoint-overhead", str(checkpoint_overhead),
        ]  # fmt: skip
        if self.shared_dir:
            self._cmd += ["--shared-dir", self.shared_dir]
        if collate:
            self._cmd += ["--collate", collate]
        # Workers import the dataset by name: give them this process's path,
        # and the service's token (the environment, not the command line
        # other users can read).
        self._env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path),
            "HINDSIGHT_DATA_TOKEN": self.dispatcher.token,
        }
        self.procs: list[subprocess.Popen[bytes]] = []
        self._started: list[float] = []
        self._quick = [0] * n  # consecutive deaths right after start, per slot
        self.replaced = 0
        self.quick_deaths = 0
        self.last_exit: int | None = None
        # (pid, exit code) of every worker that died: named in the error
        # that ends an epoch (a dataset item that crashes its worker).
        self.deaths: list[tuple[int, int]] = []
        self._dead: set[subprocess.Popen[bytes]] = set()
        self._closing = threading.Event()
        try:
            for _ in range(n):
                self._start(None)
        except BaseException:
            self.close()
            raise
        self._watch = threading.Thread(target=self._watcher, name="hindsight-data-workers", daemon=True)
        self._watch.start()

    def _start(self, slot: int | None) -> None:
        p = subprocess.Popen(self._cmd, env=self._env, stdout=subprocess.DEVNULL)
        if slot is None:
            self.procs.append(p)
            self._started.append(time.monotonic())
        else:
            self.procs[slot] = p
            self._started[slot] = time.monotonic()

    def _watcher(self) -> None:
        while not self._closing.wait(0.1):
            for i, p in enumerate(self.procs):
                code = p.poll()
                if code is None or self._closing.is_set() or p in self._dead:
                    continue
                # Counted once (a slot that is not restarted keeps its dead process).
                self._dead.add(p)
                self.last_exit = code
                self.deaths.append((p.pid, code))
                if time.monotonic() - self._started[i] < 3.0:
                    self._quick[i] += 1
                    self.quick_deaths += 1
                else:
                    self._quick[i] = 0
                if self._quick[i] >= 3:
                    continue  # it cannot start: the loader says so instead of looping
                self._start(i)
                self.replaced += 1

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]

    def close(self) -> None:
        self._closing.set()
        if getattr(self, "_watch", None) is not None:
            self._watch.join(timeout=5)
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.dispatcher.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
        if self.shared_dir:
            shutil.rmtree(self.shared_dir, ignore_errors=True)


def _deaths(deaths: list[tuple[int, int]]) -> str:
    """'pid 12 killed by SIGSEGV, pid 14 exited with 1' (the last few)."""
    out = []
    for pid, code in deaths[-4:]:
        if code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exited with {code}"
        out.append(f"pid {pid} {how}")
    more = f" ({len(deaths)} in all)" if len(deaths) > 4 else ""
    return ", ".join(out) + more


def _importable(obj: Callable[..., Any], what: str) -> str:
    """``module:qualname`` of a module-level callable, which a worker process can import."""
    name = _name(obj)
    module, _, qual = name.partition(":")
    if module in ("__main__", "__mp_main__", "?") or "<locals>" in qual or "<lambda>" in qual:
        raise InvalidArgumentError(
            f"Loader({what}=...): {name} cannot be imported by a worker process; define it at module "
            "level in a module of its own (workers import it by name, like `hindsight data worker --dataset "
            "module:factory`), and pass its arguments as dataset_args"
        )
    return name


class _EpochSetter:
    """``loader.sampler``: ``set_epoch`` for frameworks that set a loader's epoch through its sampler."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


class Loader:
    """Batches of ``dataset`` computed by worker processes, each example
    exactly once per epoch, in the order (seed, epoch) fixes.

    ``dataset`` is a factory (called with ``dataset_args``) returning a
    map-style dataset (``len`` and ``[i]``) or a sharded one (``shards()``:
    record counts, ``open(shard, offset)``: an iterator of records from
    there, and optionally ``transform(record)`` for random augmentation),
    so workers on other machines can build it.
    ``workers="local:N"`` runs N worker processes here (a drop-in for
    ``DataLoader(num_workers=N)``); ``"host:port"`` attaches to a
    dispatcher started with ``hindsight data dispatcher``.
    ``batch_size`` is per rank; rank r of R gets slice r of each global
    batch, so the global order does not depend on R.
    ``checkpoint_overhead``: local workers of a sharded dataset checkpoint a
    split's read state when a failure would otherwise redo costly reading,
    keeping the stalls under this share of their time (0: never).
    ``unit_deadline``: seconds a worker, alive and answering, may take for
    one unit before its split is given to another (a dataset item that never
    returns); after four workers in a row the epoch fails naming the
    unit's dataset indices. None: 20 times the slowest unit so far, at least
    60 s.
    """

    def __init__(
        self,
        dataset: Callable[..., Any],
        *,
        batch_size: int,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        workers: str = "local:2",
        shuffle: bool = True,
        drop_last: bool = False,
        split_batches: int = 2,
        dataset_args: dict[str, Any] | None = None,
        length: int | None = None,
        rank: int | None = None,
        world: int | None = None,
        window: int | None = None,
        nondeterministic: str = "error",
        wait: float = 60.0,
        checkpoint_overhead: float = 0.05,
        unit_deadline: float | None = None,
    ) -> None:
        if not callable(dataset):
            raise InvalidArgumentError("Loader(dataset=...) must be a factory returning a dataset")
        if nondeterministic not in ("error", "warn"):
            raise InvalidArgumentError(f"nondeterministic must be 'error' or 'warn', got {nondeterministic!r}")
        if batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be at least 1, got {batch_size}")
        args = dict(dataset_args or {})
        args_json = canonical_args(args)
        if rank is None or world is None:
            rank, world = _world()
        shards: list[int] = []
        if length is None:
            probe = dataset(**args)
            if is_sharded(probe):
                shards = [int(n) for n in probe.shards()]
                length = sum(shards)
            else:
                length = len(probe)
        name = _importable(dataset, "dataset")
        collate_name = _importable(collate_fn, "collate_fn") if collate_fn is not None else None
        version = code_version(dataset, collate_fn)
        self.spec = _native.JobSpec(
            dataset=name,
            dataset_args=args_json,
            code_version=version,
            seed=seed,
            length=length,
            global_batch=batch_size * world,
            split_batches=split_batches,
            drop_last=drop_last,
            shuffle=shuffle,
            shards=shards,
        )
        self.rank, self.world = rank, world
        self._local: _LocalWorkers | None = None
        if workers.startswith("local:"):
            try:
                n = int(workers.removeprefix("local:"))
            except ValueError:
                n = 0
            if n < 1:
                raise InvalidArgumentError(f"workers={workers!r}: local:N needs N >= 1")
            self._local = _LocalWorkers(n, name, args_json, collate_name, checkpoint_overhead)
            address = self._local.address
            window = window or max(2, 2 * n)
        else:
            address = workers.removeprefix("grpc://")
            window = window or 8
        self._client_args = {
            "rank": rank,
            "world": world,
            "window_splits": window,
            "no_worker_wait": wait,
            "unit_deadline": unit_deadline,
            "warn_nondeterministic": nondeterministic == "warn",
            "shared_dir": self._local.shared_dir if self._local is not None else None,
            # Remote workers: the token from HINDSIGHT_DATA_TOKEN(_FILE).
            "token": self._local.dispatcher.token if self._local is not None else None,
        }
        try:
            self._client = _native.DataClient(address, self.spec, **self._client_args)  # type: ignore[arg-type]
        except BaseException:
            self.close()
            raise
        self._address = address
        self.epoch = 0
        self._position = 0
        self._resume: int | None = None
        # The epoch a restored position belongs to: a framework that moves
        # on to the next epoch (a checkpoint after an epoch's last batch)
        # must not start that epoch at the old position.
        self._resume_epoch = 0

    @property
    def job_id(self) -> str:
        return self._client.job_id

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration delivers (its order and randomness)."""
        self.epoch = int(epoch)

    @property
    def sampler(self) -> _EpochSetter:
        """What frameworks call ``set_epoch`` on at each epoch's start, as on a
        ``DataLoader``'s sampler (Lightning, Accelerate): it sets this loader's epoch."""
        return _EpochSetter(self)

    def __len__(self) -> int:
        return self.spec.batches_per_epoch()

    def __iter__(self) -> Iterator[Any]:
        start = self._resume if self._resume is not None and self.epoch == self._resume_epoch else 0
        self._resume = None
        self._client.start_epoch(self.epoch, start)
        self._position = start
        try:
            yield from self._deliver()
        finally:
            # Left early (break, an exception, a new iter()): the workers
            # stop computing for this epoch at once.
            self._client.stop_epoch()

    def _deliver(self) -> Iterator[Any]:
        while True:
            try:
                unit = self._client.next()
            except HindsightError as e:
                local = self._local
                err = e
                if isinstance(e, NoDataWorkersError) and local is not None and local.quick_deaths:
                    err = NoDataWorkersError(
                        f"{e}; local workers exited right after starting ({local.quick_deaths} times, "
                        f"last exit code {local.last_exit}; their errors are on stderr)"
                    )
                if local is not None and local.deaths:
                    # A dataset item that crashes its worker: say how they died.
                    err.add_note("hindsight: local data workers died while it ran: " + _deaths(local.deaths))
                if err is e:
                    raise
                raise err from e
            if unit is None:
                return
            self._position = unit.batch + 1
            yield decode(unit.payload)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: a few integers and the job's identity."""
        s = self.spec
        return {
            "epoch": self.epoch,
            "batch": self._position,
            "job_id": self.job_id,
            "job": {
                "dataset": s.dataset,
                "dataset_args": s.dataset_args,
                "code_version": s.code_version,
                "seed": s.seed,
                "length": s.length,
                "global_batch": s.global_batch,
                "split_batches": s.split_batches,
                "drop_last": s.drop_last,
                "shuffle": s.shuffle,
                "shards": list(s.shards),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the exact next batch of the recorded epoch. A loader
        whose job differs (batch size, seed, dataset code...) is refused,
        naming the difference."""
        job = state.get("job")
        if state.get("job_id") != self.job_id:
            diff = "; ".join(_native.JobSpec(**job).differences(self.spec)) if isinstance(job, dict) else "unknown job"
            raise DataMismatchError(f"the loader's input job differs from the one this state was recorded with: {diff}")
        self.epoch = int(state["epoch"])
        self._resume = int(state["batch"])
        self._resume_epoch = self.epoch
        self._position = self._resume

    def stats(self) -> dict[str, Any]:
        out = dict(self._client.stats())
        if self._local is not None:
            out["workers_replaced"] = self._local.replaced
        return out

    def worker_pids(self) -> list[int]:
        """The live local worker processes (for tests and tooling)."""
        return self._local.pids() if self._local is not None else []

    def close(self) -> None:
        client = getattr(self, "_client", None)
        if client is not None:
            client.close()
        if self._local is not None:
            self._local.close()
            self._local = None

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

"""Checkpoints of ``torch.distributed`` jobs (DDP, FSDP2, DTensor), in a
:class:`hindsight.Store` every rank reaches.

``save`` is called by every rank. Each rank writes only what it owns:

- the local shards of its DTensors (FSDP2 parameters and optimizer state),
  with their place in the whole tensor;
- a share of the replicated plain tensors (DDP's model and optimizer): each
  is written by one rank, spread so that every rank writes about as much;
- its own ``rank_state`` (RNG states, a sampler position), kept per rank.

Each rank's part commits once its bytes are durable; ``DistSave.wait`` (on
every rank) then merges the parts into one manifest, committed last, so a
checkpoint is listed only when every rank's part is there, the ranks agree on
every value they share, and the shards tile every tensor. A rank that dies
mid-save leaves nothing listed.

``load`` reads into the tensors of a live state dict on any number of ranks
(N→M, one included): each rank reads only the chunks that overlap its
shards, every byte verified. ``consolidate`` writes one whole state dict
(safetensors) for inference or export.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from hindsight import _native, _preemption
from hindsight._store import SaveHandle, Store, _make_array
from hindsight.errors import UnsupportedTypeError, about

__all__ = ["DistSave", "Loaded", "StopOnSignal", "consolidate", "load", "save"]

_STATE = "state"
_RANK_STATE = "rank_state"


def _torch() -> Any:
    import torch

    return torch


def _world(group: Any) -> tuple[int, int]:
    dist = _torch().distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


# Per process group: the nonce its ranks agreed on, and the saves so far.
_attempts: dict[int | None, list[Any]] = {}


def _save_attempt(group: Any, rank: int, world: int) -> str:
    """The id of this save, the same on every rank of ``group``: a nonce
    rank 0 draws once per process group and shares (one broadcast in the
    job's life), and the count of saves since. A save is a collective
    call, so every rank counts alike. Another launch of the job, or another
    job saving the same name, draws another nonce: a commit merges only its
    own attempt's parts (core `checkpoint::shard::part_name`)."""
    key = None if group is None else id(group)
    st = _attempts.get(key)
    if st is None:
        nonce: list[Any] = [secrets.token_hex(8) if rank == 0 else None]
        if world > 1:
            dist = _torch().distributed
            src = 0 if group is None else dist.get_global_rank(group, 0)
            dist.broadcast_object_list(nonce, src=src, group=group)
        st = _attempts[key] = [nonce[0], 0]
    st[1] += 1
    return f"{st[0]}{st[1]:x}"


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def _local_box(t: Any, key: str) -> tuple[Any, list[int], list[int]]:
    """A DTensor's local tensor, and the offset and shape of the box of the
    whole tensor it holds."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Partial) for p in t.placements):
        raise about(
            UnsupportedTypeError(
                f"the DTensor at key '{key}' has a Partial placement (values still to be reduced); "
                "redistribute it to Shard or Replicate before saving"
            ),
            key_path=key,
        )
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    if list(local.shape) != list(shape):
        # FSDP2 may pad a local shard; the box is what belongs to the tensor.
        local = local[tuple(slice(0, n) for n in shape)]
    return local, [int(o) for o in offset], [int(n) for n in shape]


def _walk(obj: Any, key: str, visit: Any) -> Any:
    """A copy of the tree with each tensor replaced by ``visit(t, key)``
    (a value, or ``_DROP`` to leave a dict entry out)."""
    torch = _torch()
    if isinstance(obj, torch.Tensor):
        return visit(obj, key)
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            r = _walk(v, f"{key}/{k}" if key else str(k), visit)
            if r is not _DROP:
                out[k] = r
        return out
    if isinstance(obj, (list, tuple)):
        # Entries of a sequence keep their places: every rank writes them.
        items = [_walk(v, f"{key}/{i}", lambda t, k: visit(t, k, keep=True)) for i, v in enumerate(obj)]
        return type(obj)(items) if isinstance(obj, list) else tuple(items)
    return obj


_DROP = object()


@dataclass
class DistSave:
    """A save in flight on every rank; ``wait`` (called by every rank, like
    the save) returns once the checkpoint is committed."""

    store: Store
    name: str
    rank: int
    world: int
    part: SaveHandle
    group: Any
    #: The save attempt the ranks agreed on: its parts alone are committed.
    attempt: str
    #: Bytes of tensors this rank wrote (its shards and replicated share).
    nbytes: int
    _done: bool = False
    _committer: threading.Thread | None = None
    _error: BaseException | None = None

    def commit_in_background(self, timeout: float = 600.0) -> None:
        """Commit without the ranks meeting again: rank 0 commits on a
        thread once every part is durable; the others only write theirs.
        For a caller whose ranks may part before a next collective (a
        recording's loop left by an exception on one rank); rank 0 learns
        the outcome from ``committed``."""
        self._done = True
        if self.rank != 0:
            return

        def commit() -> None:
            try:
                self.part.wait()
                self.store._native.commit_parts(self.name, self.world, self.attempt, timeout)
            except BaseException as e:  # noqa: BLE001 - raised by committed()
                self._error = e

        self._committer = threading.Thread(target=commit, name=f"hindsight-commit-{self.name}", daemon=True)
        self._committer.start()

    def committed(self, timeout: float | None = None) -> bool:
        """Rank 0 (after ``commit_in_background``): whether the commit is
        done, waiting up to ``timeout`` (None: as long as it takes); its
        error is raised. Other ranks: whether their part is durable."""
        if self._committer is None:
            return self.part.wait(timeout) is not None
        self._committer.join(timeout)
        if self._committer.is_alive():
            return False
        if self._error is not None:
            e, self._error = self._error, None
            raise e
        return True

    def wait(self, timeout: float = 600.0) -> None:
        if self._done:
            return
        self._done = True
        err: str | None = None
        try:
            self.part.wait()
            if self.rank == 0:
                self.store._native.commit_parts(self.name, self.world, self.attempt, timeout)
        except Exception as e:  # every rank must hear of it, not only this one
            err = f"rank {self.rank}: {type(e).__name__}: {e}"
            if self.world == 1:
                raise
        if self.world > 1:
            dist = _torch().distributed
            errs: list[Any] = [None] * self.world
            dist.all_gather_object(errs, err, group=self.group)
            failed = [e for e in errs if e]
            if failed:
                from hindsight.errors import HindsightError

                raise HindsightError(f"checkpoint '{self.name}' was not committed: " + "; ".join(failed))


_pending: dict[tuple[int, str], DistSave] = {}


def save(
    store: Store,
    name: str,
    state: Any,
    *,
    rank_state: Any = None,
    meta: Mapping[str, object] | None = None,
    group: Any = None,
    _background: bool = False,
) -> DistSave:
    """Save ``state`` (the same tree on every rank: a model's and optimizer's
    state dicts) as checkpoint ``name``, from every rank of ``group``.

    Returns once this rank's bytes are copied; call ``wait()`` on every rank
    to know it is committed (the next ``save`` on the store waits for the
    previous one first). ``rank_state`` is kept per rank and given back by
    ``load`` on the same world size.
    """
    torch = _torch()
    DTensor = _dtensor_type()
    rank, world = _world(group)
    prev = _pending.pop((id(store), store.path), None)
    if prev is not None:
        prev.wait()

    # Which rank writes each replicated plain tensor: the same plan on every rank.
    replicated: list[tuple[str, Any]] = []

    def collect(t: Any, key: str, keep: bool = False) -> Any:
        if DTensor is None or not isinstance(t, DTensor):
            replicated.append((key, t))
        return t

    _walk(state, "", collect)
    plan = _native.plan_replicated(
        [f"{k}|{t.dtype}|{tuple(t.shape)}" for k, t in replicated],
        [t.numel() * t.element_size() for _, t in replicated],
        world,
    )
    owner = {k: o for (k, _), o in zip(replicated, plan.owners, strict=True)}
    written = 0
    pieces: dict[int, tuple[list[int], list[int]]] = {}

    def mine(t: Any, key: str, keep: bool = False) -> Any:
        nonlocal written
        if DTensor is not None and isinstance(t, DTensor):
            local, offset, _ = _local_box(t, key)
            pieces[id(local)] = (list(t.shape), offset)
            written += local.numel() * local.element_size()
            return local
        if owner.get(key, 0) == rank or keep:
            if owner.get(key, 0) == rank:
                written += t.numel() * t.element_size()
            return t
        return _DROP

    part_state = _walk(state, "", mine)
    tree = {_STATE: part_state, _RANK_STATE: {rank: rank_state}}
    describe = _describe_pieces(store, pieces)
    meta_s: dict[str, object] = dict(meta or {})
    meta_s[_native.META_REPLICATED] = plan.digest
    attempt = _save_attempt(group, rank, world)
    part = _native.part_name(name, rank, world, attempt)
    with torch.no_grad():
        h = store._save_described(part, tree, describe, meta=meta_s, skip_unchanged=True, part=True)
    ds = DistSave(store, name, rank, world, h, group, attempt, written)
    if _background:
        ds.commit_in_background()
    else:
        _pending[(id(store), store.path)] = ds
    return ds


def _describe_pieces(store: Store, pieces: Mapping[int, tuple[list[int], list[int]]]) -> Any:
    """The engine's ``describe`` hook for a tree holding DTensors' local
    boxes: each box (by ``id``) is a piece of its whole array, at its place
    (``pieces``: the whole shape and the offset)."""

    def describe(obj: Any, key: str) -> Any:
        view = store._describe(obj, key, False)
        where = pieces.get(id(obj))
        if where is None or not isinstance(view, _native.ArrayView):
            return view
        return _native.ArrayView(
            lib=view.lib,
            dtype=view.dtype,
            shape=view.shape,
            ptr=view.ptr,
            nbytes=view.nbytes,
            owner=view.owner,
            device=view.device,
            host=view.host,
            version=view.version,
            global_shape=where[0],
            offset=where[1],
        )

    return describe


def check_own_pieces(store: Store, name: str, state: Any, path: list[str]) -> _native.StateCheck:
    """The live ``state`` against checkpoint ``name``'s sub-tree at ``path``
    (a replay's check), each DTensor by this rank's own box, compared with
    the piece the recording saved there: nothing is gathered whole."""
    DTensor = _dtensor_type()
    pieces: dict[int, tuple[list[int], list[int]]] = {}

    def own(t: Any, key: str, keep: bool = False) -> Any:
        if DTensor is None or not isinstance(t, DTensor):
            return t
        local, offset, _ = _local_box(t, key)
        pieces[id(local)] = (list(t.shape), offset)
        return local

    live = _walk(state, "", own)
    return store._check_described(name, live, _describe_pieces(store, pieces), path)


class Loaded:
    """What ``load`` gives back besides the tensors it filled in place."""

    def __init__(self, name: str, state: Any, rank_state: Any, saved_world: int, world: int) -> None:
        #: The state tree: the live tensors (now holding the checkpoint's
        #: values) and the checkpoint's plain values.
        self.state = state
        #: How many ranks saved the checkpoint.
        self.saved_world = saved_world
        self._name = name
        self._rank_state = rank_state
        self._world = world

    @property
    def rank_state(self) -> Any:
        """This rank's ``rank_state`` as saved. Only on the saved world size:
        on another, per-rank state (RNG streams, a ``DistributedSampler``'s
        place in its shard of the data) has no rank to go to, and asking for
        it is an error rather than a guess."""
        if self._world != self.saved_world:
            from hindsight.errors import InvalidArgumentError

            raise InvalidArgumentError(
                f"checkpoint '{self._name}' was saved by {self.saved_world} ranks and this job has {self._world}: "
                "per-rank state (RNG streams, a DistributedSampler's position) resumes exactly only on the same "
                "world size. Relaunch with the saved size, or start the data epoch afresh (the weights and "
                "optimizer state are loaded)"
            )
        return self._rank_state


def load(store: Store, name: str, state: Any, *, group: Any = None) -> Loaded:
    """Load checkpoint ``name`` into the tensors of ``state`` in place, on
    any number of ranks: a DTensor receives the box of the whole tensor its
    local shard holds, a plain tensor the whole tensor. Only the chunks
    overlapping what this rank holds are read, and each is verified.
    Plain values (ints, lists of hyperparameters) come from the checkpoint
    in the returned ``Loaded.state``."""
    torch = _torch()
    DTensor = _dtensor_type()
    rank, world = _world(group)
    info = store.info(name)
    saved_world = int(info["meta"].get(_native.META_WORLD, "1"))

    # Every box this rank holds, read in one call (one manifest read, all
    # chunks on the engine's threads), then copied into place.
    targets: list[tuple[Any, str]] = []
    wanted: list[Any] = []

    def fill(t: Any, key: str) -> Any:
        target = t
        if DTensor is not None and isinstance(t, DTensor):
            target, offset, shape = _local_box(t, key)
        else:
            offset, shape = [0] * t.dim(), list(t.shape)
        keys = [_STATE, *key.split("/")] if key else [_STATE]
        targets.append((target, key))
        wanted.append(_native.RegionRequest(path=keys, whole=list(t.shape), offset=offset, shape=shape))
        return t

    def walk(obj: Any, key: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return fill(obj, key)
        if not _has_tensor(obj):
            return store.load(name, path=[_STATE, *key.split("/")] if key else [_STATE])
        if isinstance(obj, Mapping):
            return {k: walk(v, f"{key}/{k}" if key else str(k)) for k, v in obj.items()}
        items = [walk(v, f"{key}/{i}") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)

    out = walk(state, "")
    regions = store._native.read_regions(name, wanted)
    with torch.no_grad():
        for (target, key), region in zip(targets, regions, strict=True):
            if region.dtype != str(target.dtype).removeprefix("torch."):
                raise about(
                    UnsupportedTypeError(
                        f"checkpoint '{name}' holds {region.dtype} at key '{key}', the live tensor is {target.dtype}"
                    ),
                    checkpoint=name,
                    key_path=key,
                )
            if target.numel():
                target.copy_(torch.frombuffer(region.data, dtype=target.dtype).reshape(target.shape))
    rank_state = None
    if saved_world == world:
        rank_state = store.load(name, path=[_RANK_STATE, str(rank)], allow_pickle=False)
    return Loaded(name, out, rank_state, saved_world, world)


def holds_dtensor(obj: Any) -> bool:
    """Whether ``obj`` (a state tree: state dicts, modules' and optimizers')
    holds a DTensor, which only this module's save keeps whole. No DTensor
    exists before its module was imported: importing it to ask (400 ms of
    CPU, charged to a run's first checkpoint) is not needed."""
    module = sys.modules.get("torch.distributed.tensor")
    DTensor = getattr(module, "DTensor", None)
    return DTensor is not None and _has_tensor(obj, lambda t: isinstance(t, DTensor))


def _has_tensor(obj: Any, which: Any = None) -> bool:
    """Whether ``obj`` holds a tensor (one ``which`` accepts), stopping at the first."""
    torch = _torch()
    if isinstance(obj, torch.Tensor):
        return which is None or bool(which(obj))
    if isinstance(obj, Mapping):
        return any(_has_tensor(v, which) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v, which) for v in obj)
    return False


def load_onto_live(
    store: Store, name: str, path: list[str], objects: Mapping[str, Any], entries: Iterable[str]
) -> dict[str, Any]:
    """The sub-tree at ``path`` of an ``hs.loop`` checkpoint (``{"objects":
    ..., "grads": ...}``) as ``load_state_dict`` of the live ``objects``
    takes it. Where those hold DTensors (FSDP2), this rank reads only its
    own box of each saved array (verified), never the whole one, and gets a
    DTensor of the live layout: a module's entries by name, an optimizer's
    state by its parameters' order (its state may not exist yet: a resumed
    process has not stepped), gradients by parameter. ``entries``: the
    checkpoint's key paths (``Store.info``)."""
    DTensor = _dtensor_type()
    live = {} if DTensor is None else _live_shards(objects, path, entries)
    part = store._load_leaving_out(name, path, [list(k) for k in live])
    tree: dict[str, Any] = part.tree
    requests: list[Any] = []
    places: list[tuple[tuple[str, ...], Any]] = []
    for out in part.left_out:
        rel = tuple(out.path[len(path) :])
        like, strict = live[rel]
        key = "/".join(rel)
        if list(out.shape) == list(like.shape):
            _, offset, shape = _local_box(like, key)
        elif strict:
            raise about(
                UnsupportedTypeError(
                    f"the checkpoint holds shape {tuple(out.shape)} at key '{key}', the live DTensor {tuple(like.shape)}"
                ),
                key_path=key,
            )
        else:  # a per-parameter value of another shape (Adam's step): whole
            offset, shape, like = [0] * len(out.shape), list(out.shape), None
        requests.append(_native.RegionRequest(path=list(out.path), whole=list(out.shape), offset=offset, shape=shape))
        places.append((rel, like))
    regions = store._native.read_regions(name, requests) if requests else []
    for (rel, like), region in zip(places, regions, strict=True):
        t = _make_array(region.lib, region.dtype, tuple(region.shape), region.data, None, None)
        if like is not None:
            t = DTensor.from_local(
                t.to(device=like.device, dtype=like.dtype).contiguous(),
                like.device_mesh,
                like.placements,
                run_check=False,
                shape=like.shape,
                stride=like.stride(),
            )
        _set_at(tree, rel, t)
    return tree


def _live_shards(
    objects: Mapping[str, Any], path: list[str], entries: Iterable[str]
) -> dict[tuple[str, ...], tuple[Any, bool]]:
    """Key paths (under ``path``) of the checkpoint's arrays that live
    DTensors hold, each with that DTensor and whether the saved array must
    have its shape (an optimizer's state may hold other values per
    parameter)."""
    torch = _torch()
    DTensor = _dtensor_type()
    found: dict[tuple[str, ...], tuple[Any, bool]] = {}
    keys = [k.split("/") for k in entries]
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            for k, v in obj.state_dict().items():
                if isinstance(v, DTensor):
                    found[("objects", name, k)] = (v, True)
            for i, p in enumerate(obj.parameters()):
                if isinstance(p, DTensor):
                    found[("grads", name, str(i))] = (p, True)
        elif isinstance(obj, torch.optim.Optimizer):
            params = [p for g in obj.param_groups for p in g["params"]]
            head = [*path, "objects", name, "state"]
            for parts in keys:
                if len(parts) != len(head) + 2 or parts[: len(head)] != head:
                    continue
                idx = parts[len(head)]
                if idx.isdigit() and int(idx) < len(params) and isinstance(params[int(idx)], DTensor):
                    found[("objects", name, "state", idx, parts[-1])] = (params[int(idx)], False)
    return found


def _set_at(tree: Any, rel: tuple[str, ...], value: Any) -> None:
    """Put ``value`` at key path ``rel`` of a loaded tree (dict keys match
    by their labels: an optimizer's state is keyed by int)."""

    def key(node: Any, label: str) -> Any:
        if isinstance(node, list):
            return int(label)
        if label in node:
            return label
        return next(k for k in node if str(k) == label)

    node = tree
    for label in rel[:-1]:
        node = node[key(node, label)]
    node[key(node, rel[-1])] = value


def consolidate(store: Store, name: str, out: str | os.PathLike[str], *, path: str = _STATE) -> dict[str, Any]:
    """Write the whole tensors of checkpoint ``name`` (however many ranks
    saved it) to one safetensors file, named by their key paths joined with
    "." (``model.0.weight``), as ``hindsight consolidate`` does. ``path``
    picks a sub-tree ("state/model"; default: the saved state). Returns the
    number of ``tensors``, their ``bytes``, and the ``skipped`` key paths of
    plain values (not tensors)."""
    keys = [k for k in path.split("/") if k]
    return store._native.export_safetensors(name, keys, os.fspath(out))


def leave_job(
    signum: int | None, checkpoint: str, code: int | None, *, requeue: bool, rank: int, fresh: bool = True
) -> NoReturn:
    """Exit this rank with the checkpoint exit code, ``checkpoint`` being
    committed; rank 0 says so and requeues a Slurm job if asked."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        # The first rank to exit makes torchrun stop the others with
        # SIGTERM: they are leaving with the checkpoint committed, so
        # that signal must not turn their exit code into -15.
        for sig in _preemption.signals(False):
            signal.signal(sig, signal.SIG_IGN)
    dist = _torch().distributed
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _preemption.leave(signum, checkpoint, code, requeue=requeue and rank == 0, announce=rank == 0, fresh=fresh)


class StopOnSignal:
    """Preemption for the whole job: a SIGTERM or SIGUSR1 that reaches any
    rank (``torchrun`` passes its own SIGTERM to every rank) stops every
    rank at the same step boundary.

    ``agreed()`` is a collective that every rank calls at each step
    boundary (one all_reduce of one integer; ``make bench-dist`` measures
    it). It returns True on every rank once any rank has received a signal;
    then save with :func:`save`, ``wait()``, and call ``leave(name)``: every
    rank exits with the checkpoint exit code (85, or the batch system's).
    Use it as a context manager to put the previous handlers back.
    """

    def __init__(self, group: Any = None, *, catch_sigint: bool = False, requeue: bool | None = None) -> None:
        self.group = group
        self.signum: int | None = None
        self._requeue = _preemption.requeue_default() if requeue is None else requeue
        self._signals = _preemption.StopSignals(catch_sigint)
        self._signals.install()

    def agreed(self) -> bool:
        torch = _torch()
        _, world = _world(self.group)
        local = self._signals.received or 0
        if world > 1:
            dist = torch.distributed
            device = "cpu"
            if dist.get_backend(self.group) == "nccl":
                device = f"cuda:{torch.cuda.current_device()}"
            t = torch.tensor([local], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            local = int(t.item())
        if local:
            self.signum = local
        return bool(local)

    def leave(self, checkpoint: str, code: int | None = None) -> NoReturn:
        """Exit every rank with the checkpoint exit code once ``checkpoint``
        is committed (rank 0 says so, and requeues a Slurm job if asked)."""
        rank, _ = _world(self.group)
        self._signals.restore()
        leave_job(self.signum, checkpoint, code, requeue=self._requeue, rank=rank)

    def close(self) -> None:
        self._signals.restore()

    def __enter__(self) -> StopOnSignal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""DataLoader iterators that outlive an iteration (minGPT's
``data_iter = iter(train_loader)`` before the loop, ``next(data_iter)`` in it).

An iterator cannot be copied, but a DataLoader's is a function of three
things: the RNG states it was created under (its workers' base seed, and a
multi-process iterator's first sampler draws), the states under which its
sampler first drew (a single-process RandomSampler draws its seed at the
first ``next``), and how many batches it has yielded. Every DataLoader
iterator made while hindsight is loaded is tagged with the first two
(`install` wraps ``DataLoader.__iter__``); a checkpoint keeps them with the
count, and a restore re-creates the iterator under the same states and steps
over the batches already consumed (the sampler's indices alone when there
are no workers), leaving every RNG as it found it.

The restore proves itself: the sampler's draw count and its last drawn
batch of indices must equal the recorded ones, or the resume stops naming
the variable (a sampler drawing from a generator that is not the loader's,
the global RNGs or a seeded one, would come out in another order).
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

from hindsight import _native
from hindsight._run import batches
from hindsight._state import note_loader_generators, rng_state, set_rng_state
from hindsight.errors import DivergenceError, ReplayError

_ORIGINAL_ITER: Any = None
#: Where torch's own DataLoader iterators are defined: the only ones tagged.
_TORCH_ITERATORS = "torch.utils.data.dataloader"


@dataclass
class _Origin:
    """What re-creates one iterator: its loader and the RNG states of its draws."""

    loader: weakref.ReferenceType[Any]
    created: dict[str, Any]
    first: dict[str, Any] | None = None
    tap: _Tap | None = field(default=None, repr=False)
    #: `created` and `first` encoded, once both are final: they never change,
    #: and every iteration's snapshot of the loop's variables encodes them.
    encoded: dict[str, Any] | None = field(default=None, repr=False)


class _Tap:
    """The iterator's sampler iterator, seen: the RNG states before its first
    draw, and how many index batches it has drawn, the last one kept."""

    __slots__ = ("count", "inner", "last", "origin")

    def __init__(self, inner: Any, origin: _Origin) -> None:
        self.inner, self.origin = inner, origin
        self.count = 0
        self.last: Any = None

    def __iter__(self) -> _Tap:
        return self

    def __next__(self) -> Any:
        if self.count == 0 and self.origin.first is None:
            loader = self.origin.loader()
            self.origin.first = _states(loader) if loader is not None else None
        idx = next(self.inner)
        self.count += 1
        self.last = idx
        return idx


# iterator -> where it came from; weak both ways (a persistent-workers loader
# holds its iterator: a strong loader reference here would keep both forever).
_ORIGINS: weakref.WeakKeyDictionary[Any, _Origin] = weakref.WeakKeyDictionary()


def _generators(loader: Any) -> list[Any]:
    """The torch generators the loader's iterator and sampler draw from
    besides the global one (``DataLoader(generator=g)``, ``RandomSampler(generator=g)``)."""
    import torch

    found: dict[int, Any] = {}
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (loader, getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator):
            found.setdefault(id(g), g)
    return list(found.values())


def _states(loader: Any) -> dict[str, Any]:
    """The RNG states now, the loader's own generators included (`_state.rng_state`)."""
    note_loader_generators(_generators(loader))
    return rng_state()


def _tracked_iter(loader: Any) -> Any:
    created = _states(loader)
    it = _ORIGINAL_ITER(loader)
    if type(it).__module__ != _TORCH_ITERATORS:
        # Another library's iterator (torchdata's StatefulDataLoader keeps
        # its own state, reading its sampler iterator): left as it is, and
        # refused if kept across iterations.
        return it
    origin = _Origin(weakref.ref(loader), created)
    sampler_iter = getattr(it, "_sampler_iter", None)
    if sampler_iter is not None:
        if getattr(it, "_num_workers", 0) > 0:
            # Workers prefetch at creation: the sampler has drawn already,
            # under the states just taken.
            origin.first = created
        tap = _Tap(sampler_iter, origin)
        it._sampler_iter = tap
        origin.tap = tap
    _ORIGINS[it] = origin
    return it


def install() -> None:
    """Tag every DataLoader iterator made from now on (idempotent; a no-op
    until the program has imported torch.utils.data)."""
    global _ORIGINAL_ITER
    data = sys.modules.get("torch.utils.data")
    if data is None or _ORIGINAL_ITER is not None:
        return
    cls = data.DataLoader
    _ORIGINAL_ITER = cls.__iter__

    def __iter__(self: Any) -> Any:
        return _tracked_iter(self)

    __iter__.__doc__ = _ORIGINAL_ITER.__doc__
    __iter__.__wrapped__ = _ORIGINAL_ITER  # type: ignore[attr-defined]
    cls.__iter__ = __iter__


def is_loader_iter(v: Any) -> bool:
    data = sys.modules.get("torch.utils.data")
    return data is not None and isinstance(v, data.dataloader._BaseDataLoaderIter)


def _origin_encoded(origin: _Origin, enc: Any) -> dict[str, Any]:
    if origin.encoded is not None:
        return origin.encoded
    out = {"created": enc(origin.created), "first": None if origin.first is None else enc(origin.first)}
    if origin.first is not None:  # the sampler drew: nothing of it changes any more
        origin.encoded = out
    return out


def encode(it: Any, enc: Any) -> dict[str, Any]:
    """The kept form of a DataLoader iterator (``enc`` encodes its parts).
    Raises ValueError with the reason when it cannot be kept."""
    origin = _ORIGINS.get(it)
    if origin is None or origin.tap is None or it._sampler_iter is not origin.tap:
        raise ValueError(
            "a DataLoader iterator made before hindsight was imported cannot be checkpointed "
            "(import hindsight before the first iter(loader))"
        )
    return {
        # How it was made: a replay worker's own unseeded RNGs differ there
        # and are not compared (core checkpoint::compare); what it yields is.
        _native.STATE_ORIGIN_KEY: _origin_encoded(origin, enc),
        "yielded": int(it._num_yielded),
        "draws": origin.tap.count,
        "last": None if origin.tap.last is None else batches.digest(origin.tap.last),
    }


def restore(current: Any, saved: dict[str, Any], name: str, dec: Any) -> Any:
    """A new iterator in the state `saved` describes, made from the loader of
    ``current`` (the iterator the resumed program holds there); the RNG
    states are left as they were."""
    origin = _ORIGINS.get(current) if is_loader_iter(current) else None
    loader = origin.loader() if origin is not None else None
    if loader is None:
        raise ReplayError(
            f"'{name}' held a DataLoader iterator; the resumed program holds "
            f"{'nothing' if current is None else type(current).__qualname__} there to re-create it from "
            "(make it with iter(loader) before the loop, after importing hindsight)"
        )
    made = saved[_native.STATE_ORIGIN_KEY]
    now = rng_state()
    try:
        set_rng_state(dec(made["created"]))
        it = iter(loader)
        if made["first"] is not None and it._num_workers == 0:
            set_rng_state(dec(made["first"]))
        advance(it, int(saved["yielded"]))
        tap = _ORIGINS[it].tap
        last = None if tap is None or tap.last is None else batches.digest(tap.last)
        if tap is None or tap.count != saved["draws"] or last != saved["last"]:
            raise DivergenceError(
                f"resume: the DataLoader iterator '{name}', re-created and advanced by {saved['yielded']} "
                "batches, does not draw the recorded indices: its sampler draws from a generator hindsight "
                "does not checkpoint (seed one and pass it: DataLoader(generator=g))"
            )
    finally:
        set_rng_state(now)
    if current is not it and getattr(current, "_num_workers", 0) > 0:
        current._shutdown_workers()
    return it


def skips_loading(it: Any) -> bool:
    """Whether `advance` steps over `it`'s batches without loading them: a
    map-style dataset without workers (its sampler's indices alone; a
    sample loaded now would draw from the RNGs at other states than then,
    as the zoo's siamese Dataset does)."""
    if not is_loader_iter(it) or it._num_workers != 0:
        return False
    from torch.utils.data.dataloader import _DatasetKind

    return bool(it._dataset_kind == _DatasetKind.Map)


def order_tap(it: Any) -> _Tap | None:
    """What a step of `it` was loaded from (the tap's ``last`` index batch),
    where a resume would step over `it` without loading (`skips_loading`):
    recording fingerprints it, so that the resume has something to check."""
    origin = _ORIGINS.get(it) if skips_loading(it) else None
    return None if origin is None or it._sampler_iter is not origin.tap else origin.tap


def skip_orders(it: Any, n: int) -> list[str]:
    """Step over n batches of a loader that `skips_loading`, returning the
    fingerprints of the index batches its sampler drew for them."""
    drawn = [batches.digest(next(it._sampler_iter)) for _ in range(n)]
    it._num_yielded += n
    return drawn


def advance(it: Any, n: int) -> None:
    """Step over n items of `it` (see `skips_loading`)."""
    if skips_loading(it):
        for _ in range(n):
            next(it._sampler_iter)
        it._num_yielded += n
        return
    for _ in range(n):
        next(it)

"""Hugging Face Accelerate: hindsight checkpoints, preemption and replay for
a training loop written with ``accelerate.Accelerator``.

    import hindsight as hs
    import hindsight.accelerate as hsa

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    with hsa.checkpointing(accelerator):
        for epoch in hs.loop("epoch", range(epochs)):
            for step, batch in hs.loop("step", enumerate(loader)):
                with accelerator.accumulate(model):
                    ...
                    accelerator.backward(loss)
                    optimizer.step(); scheduler.step(); optimizer.zero_grad()
                hs.log("loss", loss.item())

An accelerate loop is a plain PyTorch loop over prepared objects, so
``hs.loop``/``hs.checkpointing`` run it; what they would miss is the state
accelerate keeps itself, which this module translates into checkpointed
objects (`checkpointing`):

- every model, optimizer, scheduler the accelerator prepared, its grad
  scaler and the objects given to ``accelerator.register_for_checkpointing``;
- accelerate's loop state (`LoopState`): ``accelerator.step`` (the position
  in a gradient-accumulation window: a resume inside a window goes on with
  the same micro-steps before the next optimizer step, the gradients
  accumulated so far being part of every checkpoint), whether gradients are
  synchronised now, the epoch counter of every prepared DataLoader
  (``DataLoaderShard.iteration``, which seeds the order of accelerate's
  seedable sampler) and its sampler's epoch, and the save-state counter.

Plain ``hs.checkpointing()`` keeps the same loop state when the loop calls
the accelerator (``accelerator.accumulate``, ``accelerator.backward``): the
Accelerator is then a loop variable, kept through `LoopState`. This module
is the explicit form, and covers what the loop does not name.

When to save, where to resume and what a replay visits stay the run
session's (``hindsight.session``); nothing here decides them. The data
position inside an epoch is ``hs.loop``'s (``accelerator.skip_first_batches``
is not needed: the resumed loop steps over the consumed batches itself and
checks them against the recording's fingerprints).

`save_state`/`load_state` are ``accelerator.save_state(dir)`` and
``load_state(dir)`` backed by a :class:`hindsight.Store`: the same objects
plus the RNG states (Python, NumPy, torch, CUDA, and the generators of the
prepared DataLoaders), deduplicated, and verified byte for byte on load.

Refused, naming the reason: an accelerator of more than one process (each
rank would record and resume on its own: not exact), and a DataLoader that
dispatches batches from process 0 (``DataLoaderDispatcher``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hindsight import _run
from hindsight._run.accelstate import LoopState
from hindsight._state import apply_state, capture, set_rng_state
from hindsight._store import Store
from hindsight.errors import InvalidArgumentError

__all__ = ["LoopState", "checkpointing", "load_state", "save_state"]

#: hs.checkpointing's own keyword arguments (the rest are objects).
_SETTINGS = (
    "every",
    "keep_last",
    "keep_best",
    "best_metric",
    "best_mode",
    "keep_every",
    "safety_minutes",
    "exit_code",
    "requeue",
    "store",
    "local_first",
    "transient",
)


def _check(accelerator: Any, what: str) -> None:
    if not all(hasattr(accelerator, a) for a in ("_models", "_optimizers", "gradient_state", "step")):
        raise InvalidArgumentError(f"{what}: expected an accelerate.Accelerator, got {type(accelerator).__qualname__}")
    n = int(accelerator.num_processes)
    if n != 1:
        raise InvalidArgumentError(
            f"{what}: this accelerator runs {n} processes; hindsight records and resumes one process "
            "(each rank would checkpoint and resume on its own, not as one run)"
        )
    for dl in accelerator._dataloaders:
        if type(dl).__name__ == "DataLoaderDispatcher":
            raise InvalidArgumentError(
                f"{what}: a DataLoader prepared with dispatch_batches=True (DataLoaderDispatcher) is not "
                "supported: its batches come from process 0 and their position cannot be restored exactly"
            )


def _objects(accelerator: Any, given: dict[str, Any], generators: bool) -> dict[str, Any]:
    """The objects a checkpoint of this accelerator holds, by stable key:
    those given, then what accelerate prepared or had registered (each once)."""
    out = dict(given)
    seen = {id(o) for o in out.values()}

    def add(kind: str, objs: list[Any]) -> None:
        for i, o in enumerate(objs):
            if id(o) not in seen:
                seen.add(id(o))
                out[f"accelerate.{kind}{i}"] = o

    add("model", list(accelerator._models))
    add("optimizer", list(accelerator._optimizers))
    add("scheduler", list(accelerator._schedulers))
    if getattr(accelerator, "scaler", None) is not None:
        add("scaler", [accelerator.scaler])
    custom = list(getattr(accelerator, "_custom_objects", []))
    for i, o in enumerate(custom):
        if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None))):
            raise InvalidArgumentError(
                f"accelerator.register_for_checkpointing object {i} ({type(o).__qualname__}) has no "
                "state_dict/load_state_dict"
            )
    add("registered", custom)
    out["accelerate.loop"] = LoopState(accelerator, generators)
    return out


@contextmanager
def checkpointing(accelerator: Any, **kwargs: Any) -> Iterator[None]:
    """``hs.checkpointing`` for a loop over objects ``accelerator.prepare``
    returned: everything ``accelerator.save_state`` would save (models,
    optimizers, schedulers, grad scaler, registered objects, RNG states,
    the DataLoaders' epochs, ``accelerator.step``) is in each checkpoint.

    Keyword arguments are ``hs.checkpointing``'s (``every``, ``keep_last``,
    ``store``, ``transient``, ...) and further objects to checkpoint by name
    (an EMA model the accelerator did not prepare). Objects the accelerator
    prepares after this point are not included: prepare first."""
    _check(accelerator, "hindsight.accelerate.checkpointing")
    settings = {k: v for k, v in kwargs.items() if k in _SETTINGS}
    given = {k: v for k, v in kwargs.items() if k not in _SETTINGS}
    objects = _objects(accelerator, given, generators=False)
    with _run.checkpointing(**settings, **objects):
        yield


def _store(store: Store | str | os.PathLike[str]) -> Store:
    return store if isinstance(store, Store) else Store(store)


def save_state(accelerator: Any, store: Store | str | os.PathLike[str], name: str, **objects: Any) -> None:
    """``accelerator.save_state`` into a hindsight store, under ``name``:
    the prepared models, optimizers, schedulers, grad scaler, registered
    objects, accelerate's loop state and every RNG state (Python, NumPy,
    torch, CUDA, the prepared DataLoaders' generators), plus ``objects``.
    Returns once the checkpoint is durable."""
    _check(accelerator, "hindsight.accelerate.save_state")
    st = _store(store)
    state = capture(_objects(accelerator, objects, generators=True), [])
    st.save(name, state, meta={"accelerate": True}).wait()
    st.flush()


def load_state(accelerator: Any, store: Store | str | os.PathLike[str], name: str, **objects: Any) -> None:
    """``accelerator.load_state`` from a checkpoint `save_state` wrote: every
    byte is verified against its hash (a damaged checkpoint raises
    ``CorruptError`` and nothing is applied), then the state is put back into
    the live objects and the RNG states are set."""
    _check(accelerator, "hindsight.accelerate.load_state")
    state = _store(store).load(name)
    apply_state(_objects(accelerator, objects, generators=True), state["objects"], name)
    set_rng_state(state["rng"])

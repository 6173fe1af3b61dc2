"""State capture shared by `hs.checkpointing` and the Lightning callback: the
RNG states a checkpoint must carry for an exact resume, and putting saved
state back into live objects."""

from __future__ import annotations

import random
import sys
import weakref
from array import array
from collections.abc import Mapping
from typing import Any

from hindsight.errors import InvalidArgumentError, ReplayError

# The generators DataLoaders draw from besides the global ones
# (`DataLoader(generator=g)`, PyTorch's recipe for reproducible loading): the
# next epoch's order comes from them, so they are RNG state too. Each is
# keyed by its device, its seed and how many such were seen before it, the
# same in a resumed process that makes its loaders in the same order.
_LOADER_GENS: list[tuple[str, weakref.ReferenceType[Any]]] = []
# States a restore found no such generator for yet: applied when a loader
# first draws from it (the resumed program makes its loader after the restore).
_PENDING: dict[str, Any] = {}
# Python's Mersenne Twister state is 625 ints: kept as their bytes (one value
# instead of 625 for every walk of a checkpoint's tree, several per save).
_WORD = "I" if array("I").itemsize == 4 else "L"


def note_loader_generators(gens: list[Any]) -> None:
    """`gens` are about to give a DataLoader iterator its order: from now on
    they are part of `rng_state`, and a state a restore left for one is set."""
    import torch

    for g in gens:
        if g is torch.default_generator or any(ref() is g for _, ref in _LOADER_GENS):
            continue
        base = f"{g.device}/{g.initial_seed()}"
        key = f"{base}/{sum(1 for k, _ in _LOADER_GENS if k.rpartition('/')[0] == base)}"
        _LOADER_GENS.append((key, weakref.ref(g)))
        if key in _PENDING:
            g.set_state(_PENDING.pop(key))


def rng_state() -> dict[str, Any]:
    """Python's, NumPy's (if imported), torch's and CUDA's (if initialized)
    RNG states, and those of the generators DataLoaders drew from."""
    version, words, gauss = random.getstate()
    state: dict[str, Any] = {"python": (version, array(_WORD, words).tobytes(), gauss)}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
    loaders = {key: g.get_state() for key, ref in _LOADER_GENS if (g := ref()) is not None}
    if loaders:
        state["loaders"] = loaders
    return state


def rng_as_recorded(state: dict[str, Any], entries: list[tuple[str, str, int]]) -> dict[str, Any]:
    """``state`` (a capture, holding `rng_state`'s) in the form of a
    checkpoint with these ``entries`` (`Store.info`): one recorded before
    Python's RNG state was packed holds its 625 words one by one, and a
    replay comparing against it must too, or every check would report the
    same state as different."""
    if not any(path.endswith("rng/python/1/0") for path, *_ in entries):
        return state
    rng = state.get("rng")
    if not isinstance(rng, dict) or not isinstance(rng.get("python", (None, None))[1], bytes):
        return state
    v = rng["python"]
    return {**state, "rng": {**rng, "python": (v[0], tuple(array(_WORD, v[1])), v[2])}}


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Apply what `rng_state` captured (also after a round trip that turned tuples into lists)."""
    if "python" in state:
        v = state["python"]
        # Bytes since the state was packed; a tuple (or a list, after a
        # round trip) in checkpoints from before.
        words = tuple(array(_WORD, v[1])) if isinstance(v[1], bytes) else tuple(v[1])
        random.setstate((v[0], words, v[2]))
    if "numpy" in state:
        import numpy as np

        np.random.set_state(tuple(state["numpy"]))
    if "torch" in state:
        import torch

        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state["cuda"]))
    if "loaders" in state:
        live = {key: g for key, ref in _LOADER_GENS if (g := ref()) is not None}
        _PENDING.clear()
        for key, st in state["loaders"].items():
            if key in live:
                live[key].set_state(st)
            else:
                _PENDING[key] = st


def capture(objects: Mapping[str, Any], loop: list[tuple[str, int]]) -> dict[str, Any]:
    """What a checkpoint of `hs.checkpointing`'s objects holds: their state
    dicts (tensors as they are), the RNG states and the loop position."""
    objs: dict[str, Any] = {}
    for key, obj in objects.items():
        objs[key] = obj.state_dict() if hasattr(obj, "state_dict") else obj
    return {"objects": objs, "rng": rng_state(), "loop": loop}


def capture_grads(objects: Mapping[str, Any]) -> dict[str, list[Any]] | None:
    """The gradients held by the modules' parameters (None where a parameter
    has none), or None when no parameter holds one. A checkpoint taken
    between two optimizer steps (gradient accumulation interrupted by a
    signal) is complete only with them."""
    out: dict[str, list[Any]] = {}
    held = False
    for key, obj in objects.items():
        params = getattr(obj, "parameters", None)
        if not callable(params):
            continue
        grads = [None if p.grad is None else p.grad.detach() for p in params()]
        held = held or any(g is not None for g in grads)
        out[key] = grads
    return out if held else None


def apply_grads(objects: Mapping[str, Any], saved: Mapping[str, Any], checkpoint: str) -> None:
    """Put gradients saved by `capture_grads` back into the parameters."""
    for key, grads in saved.items():
        params = list(objects[key].parameters()) if key in objects else None
        if params is None or len(params) != len(grads):
            raise ReplayError(
                f"checkpoint '{checkpoint}' holds gradients for {key!r} that do not match its parameters; "
                "hs.checkpointing(...) must name the same objects as when it was recorded"
            )
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype)


def apply_state(objects: Mapping[str, Any], saved: Mapping[str, Any], checkpoint: str) -> None:
    """Put saved state back into the live objects given to hs.checkpointing."""
    missing = set(objects) - set(saved)
    if missing:
        raise ReplayError(
            f"checkpoint '{checkpoint}' has no state for {sorted(missing)}; "
            "hs.checkpointing(...) must name the same objects as when it was recorded"
        )
    import torch

    for key, obj in objects.items():
        if hasattr(obj, "load_state_dict"):
            obj.load_state_dict(saved[key])
            if isinstance(obj, torch.optim.Optimizer):
                # The restored optimizer has stepped (in the recorded run); tell
                # LR schedulers so they do not warn about step order.
                obj._opt_called = True  # type: ignore[attr-defined]
        elif isinstance(obj, torch.Tensor):
            with torch.no_grad():
                obj.copy_(saved[key])
        else:
            raise InvalidArgumentError(f"hs.checkpointing({key}=...): {type(obj).__qualname__} has no load_state_dict")


def tensor_bytes(tree: Any, device_type: str | None = None, align: int = 1) -> int:
    """Bytes of the tensors in a state tree (dicts, lists, tuples), or of
    those on one device type ("cuda"); each rounded up to ``align``. Without
    a device type, host arrays and raw bytes (a file's, as a Trainer
    checkpoint holds them) count too."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    np = sys.modules.get("numpy")
    total = 0
    stack = [tree]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if device_type is None or o.device.type == device_type:
                total += -(-int(o.numel() * o.element_size()) // align) * align
        elif device_type is None and (
            isinstance(o, (bytes, bytearray)) or (np is not None and isinstance(o, np.ndarray))
        ):
            n = len(o) if isinstance(o, (bytes, bytearray)) else int(o.nbytes)
            total += -(-n // align) * align
        elif isinstance(o, Mapping):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return total

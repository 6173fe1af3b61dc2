"""What a training step consumed, as the parts of the engine's batch
fingerprint (`runs::db::BatchDigest`): a description (dtype, shape, type)
and the bytes of every tensor and array, in a fixed walk order. Recording
stores one fingerprint per step; a resume and every replay worker compare
theirs with it, so data in another order or with other content is caught
at the first step it differs, whatever the cause.

The walk and the hash are the engine's (`_native.BatchPrinter`, one call
per step): it reads a small contiguous CPU tensor in place and hands every
other tensor or array to `_leaf`, the only part that knows torch and numpy
(sampling, device copies)."""

from __future__ import annotations

import sys
from typing import Any

from hindsight import _native

# Tensors larger than this are fingerprinted by an evenly strided sample of
# their elements (a different batch differs almost everywhere), so a step
# with a large batch pays for at most about this many bytes of hashing.
_FULL_BYTES = 16 << 20
_SAMPLE_ELEMENTS = 1 << 20
# Device tensors are sampled small: their bytes must first reach the host.
_DEVICE_SAMPLE_ELEMENTS = 4096


def _tensor(t: Any) -> list[Any]:
    import torch

    t = t.detach()
    if t.layout != torch.strided:
        return [f"tensor {t.layout} {t.dtype} {tuple(t.shape)}"]
    parts: list[Any] = [f"tensor {t.dtype} {tuple(t.shape)}"]
    flat = t.reshape(-1)
    limit = _DEVICE_SAMPLE_ELEMENTS if t.device.type != "cpu" else None
    nbytes = flat.numel() * flat.element_size()
    if limit is None and nbytes > _FULL_BYTES:
        limit = _SAMPLE_ELEMENTS
    if limit is not None and flat.numel() > limit:
        flat = flat[:: -(-flat.numel() // limit)]
    flat = flat.contiguous().cpu()
    if flat.numel():
        parts.append(flat.view(torch.uint8).numpy())
    return parts


def _leaf(x: Any) -> list[Any]:
    """The parts of what the native walk does not read itself: a tensor it
    cannot read in place, or a numpy array."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _tensor(x)
    parts: list[Any] = [f"array {x.dtype} {x.shape}"]
    if x.dtype.hasobject:
        parts.append(repr(x.tolist())[:4096])
    elif x.size:
        np = sys.modules["numpy"]
        parts.append(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
    return parts


_printer: tuple[tuple[bool, bool], _native.BatchPrinter] | None = None


def printer() -> _native.BatchPrinter:
    """The printer for the frameworks loaded now (torch or numpy may be
    imported after hindsight: a printer made before knows neither)."""
    global _printer
    loaded = ("torch" in sys.modules, "numpy" in sys.modules)
    if _printer is None or _printer[0] != loaded:
        torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
        plain = [] if torch is None else [torch.Tensor, torch.nn.Parameter]
        leaves = [m for m in (getattr(torch, "Tensor", None), getattr(np, "ndarray", None)) if m is not None]
        strided = None if torch is None else torch.strided
        _printer = (loaded, _native.BatchPrinter(plain, leaves, strided, _FULL_BYTES, _leaf))
    return _printer[1]


def digest(batch: Any) -> str:
    """The fingerprint of what one step consumed (one native call: the walk
    and the hash are the engine's; only `_leaf` is Python's)."""
    return printer().digest(batch)

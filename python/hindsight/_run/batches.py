"""What a training step consumed, as the parts of the engine's batch
fingerprint (`runs::db::BatchDigest`): a description (dtype, shape, type)
and the bytes of every tensor and array, in a fixed walk order. Recording
stores one fingerprint per step; a resume and every replay worker compare
theirs with it, so data in another order or with other content is caught
at the first step it differs, whatever the cause.

Only this walk is Python's (it knows torch and numpy); the hash and the
table are the engine's."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from hindsight import _native

# Tensors larger than this are fingerprinted by an evenly strided sample of
# their elements (a different batch differs almost everywhere), so a step
# with a large batch pays for at most about this many bytes of hashing.
_FULL_BYTES = 16 << 20
_SAMPLE_ELEMENTS = 1 << 20
# Device tensors are sampled small: their bytes must first reach the host.
_DEVICE_SAMPLE_ELEMENTS = 4096
_MAX_DEPTH = 8


def _tensor(t: Any, parts: list[Any]) -> None:
    import torch

    t = t.detach()
    if t.layout != torch.strided:
        parts.append(f"tensor {t.layout} {t.dtype} {tuple(t.shape)}")
        return
    parts.append(f"tensor {t.dtype} {tuple(t.shape)}")
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


def _walk(x: Any, parts: list[Any], depth: int) -> None:
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is not None and isinstance(x, torch.Tensor):
        _tensor(x, parts)
    elif np is not None and isinstance(x, np.ndarray):
        parts.append(f"array {x.dtype} {x.shape}")
        if x.dtype.hasobject:
            parts.append(repr(x.tolist())[:4096])
        elif x.size:
            parts.append(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
    elif x is None or isinstance(x, (bool, int, float, str, bytes)):
        parts.append(f"{type(x).__name__} {x!r}"[:4096])
    elif depth >= _MAX_DEPTH:
        parts.append(type(x).__qualname__)
    elif isinstance(x, (list, tuple)):
        parts.append(f"{type(x).__qualname__} {len(x)}")
        for v in x:
            _walk(v, parts, depth + 1)
    elif isinstance(x, Mapping):
        parts.append(f"{type(x).__qualname__} {len(x)}")
        for k, v in x.items():
            parts.append(str(k))
            _walk(v, parts, depth + 1)
    else:
        # Another object (a framework's batch class): its attributes, if
        # plain, else only its type.
        fields = getattr(x, "__dict__", None)
        parts.append(type(x).__qualname__)
        if isinstance(fields, dict) and len(fields) <= 64:
            _walk(fields, parts, depth + 1)


def digest(batch: Any) -> str:
    """The fingerprint of what one step consumed."""
    parts: list[Any] = []
    _walk(batch, parts, 0)
    return str(_native.batch_digest(parts))

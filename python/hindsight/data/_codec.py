"""The bytes of one unit: a batch (nested tensors, arrays, numbers, strings)
as a JSON header plus raw buffers. Decoding never executes code (no pickle),
and tensors are views of the received buffer, not copies."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import torch

from hindsight.errors import UnsupportedTypeError

MAGIC = b"HSU1"
_ALIGN = 64
_HEAD = struct.Struct("<4sI")


def encode(obj: Any) -> bytes:
    buffers: list[tuple[int, memoryview]] = []
    pos = 0

    def add(raw: memoryview) -> int:
        """The buffer's offset after the header (aligned, so views of any dtype work)."""
        nonlocal pos
        pos = (pos + _ALIGN - 1) // _ALIGN * _ALIGN
        buffers.append((pos, raw))
        off = pos
        pos += raw.nbytes
        return off

    def walk(o: Any, where: str) -> Any:
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            return {
                "T": add(flat.numpy().data.cast("B")),
                "n": flat.numel(),
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
            }
        if isinstance(o, np.ndarray):
            a = np.ascontiguousarray(o)
            if a.dtype.hasobject:
                raise UnsupportedTypeError(f"batch{where}: a numpy array of Python objects cannot be sent")
            return {
                "N": add(a.reshape(-1).view(np.uint8).data.cast("B")),
                "n": a.nbytes,
                "dtype": a.dtype.str,
                "shape": list(a.shape),
            }
        if isinstance(o, np.generic):
            return walk(np.asarray(o), where)
        if o is None or isinstance(o, (bool, int, float, str)):
            return {"v": o}
        if isinstance(o, (bytes, bytearray)):
            return {"B": add(memoryview(bytes(o))), "n": len(o)}
        if isinstance(o, dict):
            if all(isinstance(k, str) for k in o):
                return {"d": {k: walk(v, f"{where}[{k!r}]") for k, v in o.items()}}
            return {"kv": [[walk(k, where), walk(v, f"{where}[{k!r}]")] for k, v in o.items()]}
        if isinstance(o, tuple):
            return {"t": [walk(v, f"{where}[{i}]") for i, v in enumerate(o)]}
        if isinstance(o, list):
            return {"l": [walk(v, f"{where}[{i}]") for i, v in enumerate(o)]}
        raise UnsupportedTypeError(
            f"batch{where}: a {type(o).__name__} cannot be sent between processes; "
            "return tensors, arrays, numbers, strings, bytes and dicts/lists/tuples of them"
        )

    header = json.dumps(walk(obj, ""), separators=(",", ":")).encode()
    start = (_HEAD.size + len(header) + _ALIGN - 1) // _ALIGN * _ALIGN
    out = bytearray(start + pos)
    out[: _HEAD.size] = _HEAD.pack(MAGIC, len(header))
    out[_HEAD.size : _HEAD.size + len(header)] = header
    for off, raw in buffers:
        out[start + off : start + off + raw.nbytes] = raw
    return bytes(out)


def decode(payload: bytearray) -> Any:
    magic, hlen = _HEAD.unpack_from(payload, 0)
    if magic != MAGIC:
        raise UnsupportedTypeError("not a hindsight data unit (bad magic)")
    header = json.loads(bytes(payload[_HEAD.size : _HEAD.size + hlen]))
    start = (_HEAD.size + hlen + _ALIGN - 1) // _ALIGN * _ALIGN

    def build(node: Any) -> Any:
        if "T" in node:
            off, n = start + node["T"], node["n"]
            dtype = getattr(torch, node["dtype"])
            if n == 0:
                return torch.empty(node["shape"], dtype=dtype)
            raw = torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=off)
            return raw.view(dtype).reshape(node["shape"])
        if "N" in node:
            off = start + node["N"]
            dt = np.dtype(node["dtype"])
            count = node["n"] // dt.itemsize if dt.itemsize else 0
            return np.frombuffer(payload, dtype=dt, count=count, offset=off).reshape(node["shape"])
        if "B" in node:
            off = start + node["B"]
            return bytes(payload[off : off + node["n"]])
        if "v" in node:
            return node["v"]
        if "d" in node:
            return {k: build(v) for k, v in node["d"].items()}
        if "kv" in node:
            return {build(k): build(v) for k, v in node["kv"]}
        if "t" in node:
            return tuple(build(v) for v in node["t"])
        return [build(v) for v in node["l"]]

    return build(header)

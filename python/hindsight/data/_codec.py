"""The bytes of one unit: a batch (nested tensors, arrays, numbers, strings)
as a JSON header plus raw buffers. Decoding never executes code (no pickle),
and tensors are views of the received buffer, not copies."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import torch

from hindsight import _native
from hindsight.errors import CorruptError, UnsupportedTypeError

MAGIC = b"HSU1"
_ALIGN = 64
_HEAD = struct.Struct("<4sI")


def encode(obj: Any) -> memoryview:
    """One unit's bytes: a JSON header, then every buffer 64-byte aligned.
    Each buffer is copied once, into memory that is not zero-filled first;
    only the alignment gaps are zeroed (so equal batches are equal bytes)."""
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
    out = np.empty(start + pos, dtype=np.uint8).data.cast("B")
    out[: _HEAD.size] = _HEAD.pack(MAGIC, len(header))
    out[_HEAD.size : _HEAD.size + len(header)] = header
    end = _HEAD.size + len(header)
    for off, raw in buffers:
        out[end : start + off] = bytes(start + off - end)
        end = start + off + raw.nbytes
        out[start + off : end] = raw
    out[end:] = bytes(len(out) - end)
    return out


# The engine's table (`checkpoint::format::TORCH_DTYPES`), as checkpoints
# use it: one owner. A dtype this torch lacks cannot arrive as a tensor.
_TORCH_DTYPES = {name: getattr(torch, name) for name in _native.TORCH_DTYPES if hasattr(torch, name)}


def decode(received: bytearray | memoryview | _native.Buffer) -> Any:
    """The batch a unit holds; its tensors and arrays are views of the
    (writable) received buffer. A malformed unit (a bug or a hostile worker:
    the digest only proves it arrived as sent) raises CorruptError naming
    the node; nothing outside the payload is ever read."""
    # _native.Buffer has the buffer protocol's C slots; typeshed only sees
    # a buffer through __buffer__, which Python 3.11 does not define.
    payload = memoryview(received)  # type: ignore[arg-type]
    if len(payload) < _HEAD.size:
        raise CorruptError("data unit: shorter than its header")
    magic, hlen = _HEAD.unpack_from(payload, 0)
    if magic != MAGIC or _HEAD.size + hlen > len(payload):
        raise CorruptError("data unit: not a hindsight data unit (bad magic or header length)")
    try:
        header = json.loads(bytes(payload[_HEAD.size : _HEAD.size + hlen]))
    except ValueError as e:
        raise CorruptError(f"data unit: header is not JSON: {e}") from e
    start = (_HEAD.size + hlen + _ALIGN - 1) // _ALIGN * _ALIGN

    def bad(where: str, why: str) -> CorruptError:
        return CorruptError(f"data unit: batch{where}: {why}")

    def span(node: dict[str, Any], key: str, where: str) -> tuple[int, int]:
        off, n = node.get(key), node.get("n")
        if type(off) is not int or type(n) is not int or off < 0 or n < 0 or start + off + n > len(payload):
            raise bad(where, "buffer outside the unit")
        return start + off, n

    def shape_of(node: dict[str, Any], where: str, itemsize: int, n: int) -> list[int]:
        shape = node.get("shape")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(where, "bad shape")
        count = 1
        for d in shape:
            count *= d
        if count * itemsize != n:
            raise bad(where, "shape does not match the buffer size")
        return shape

    def build(node: Any, where: str) -> Any:
        if not isinstance(node, dict) or len(node) == 0:
            raise bad(where, "malformed node")
        if "T" in node:
            off, n = span(node, "T", where)
            dtype = _TORCH_DTYPES.get(node.get("dtype"))  # type: ignore[arg-type]
            if dtype is None:
                raise bad(where, f"unknown tensor dtype {node.get('dtype')!r}")
            shape = shape_of(node, where, dtype.itemsize, n)
            if n == 0:
                return torch.empty(shape, dtype=dtype)
            raw = torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=off)
            return raw.view(dtype).reshape(shape)
        if "N" in node:
            off, n = span(node, "N", where)
            try:
                dt = np.dtype(node.get("dtype"))
            except TypeError as e:
                raise bad(where, f"unknown array dtype {node.get('dtype')!r}") from e
            if dt.hasobject or dt.itemsize == 0:
                raise bad(where, f"array dtype {dt} cannot be received")
            shape = shape_of(node, where, dt.itemsize, n)
            return np.frombuffer(payload, dtype=dt, count=n // dt.itemsize, offset=off).reshape(shape)
        if "B" in node:
            off, n = span(node, "B", where)
            return bytes(payload[off : off + n])
        if "v" in node:
            v = node["v"]
            if v is not None and not isinstance(v, (bool, int, float, str)):
                raise bad(where, "malformed value")
            return v
        if "d" in node and isinstance(node["d"], dict):
            return {k: build(v, f"{where}[{k!r}]") for k, v in node["d"].items()}
        if "kv" in node and isinstance(node["kv"], list):
            out = {}
            for pair in node["kv"]:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise bad(where, "malformed mapping")
                key = build(pair[0], where)
                try:
                    out[key] = build(pair[1], f"{where}[{key!r}]")
                except TypeError as e:  # an unhashable key
                    raise bad(where, f"bad key: {e}") from e
            return out
        if "t" in node and isinstance(node["t"], list):
            return tuple(build(v, f"{where}[{i}]") for i, v in enumerate(node["t"]))
        if "l" in node and isinstance(node["l"], list):
            return [build(v, f"{where}[{i}]") for i, v in enumerate(node["l"])]
        raise bad(where, "malformed node")

    return build(header, "")

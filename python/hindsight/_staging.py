"""Device-side helpers of a save: proving a device tensor unchanged without
copying it to the host.

A skipped tensor must be an unchanged tensor. Torch's version counter misses
`.data` writes, numpy views and shared storages, so it only ever says "it
changed"; "unchanged" needs the whole content. For host memory the engine
fingerprints the bytes (xxh3, in Rust). For device memory, copying to the
host to hash would cost the very transfer a skip is meant to save, so the
fingerprint is a bandwidth-bound reduction computed on the device, and the
comparison too: only one boolean crosses to the host.
"""

from __future__ import annotations

from typing import Any

# Words per block of the reduction: bounds the temporaries (2 x 8 bytes per
# word) whatever the tensor's size.
_BLOCK_WORDS = 1 << 22
_MASK64 = (1 << 64) - 1
# Per-device multiplier tables, built once.
_multipliers: dict[Any, Any] = {}


def _to_i64(u: int) -> int:
    u &= _MASK64
    return u - (1 << 64) if u >= 1 << 63 else u


def _table(torch: Any, device: Any) -> Any:
    """Two lanes of odd 64-bit multipliers, one per word position in a block.

    Odd multipliers make every single-word change visible (an odd number times
    a non-zero difference is non-zero mod 2**64); pseudo-random ones make
    structured multi-word changes (swaps, shifts) collide only by chance.
    """
    t = _multipliers.get(device)
    if t is None:
        g = torch.Generator(device="cpu").manual_seed(0x68696E6473696768)
        lanes = torch.randint(-(1 << 62), 1 << 62, (2, _BLOCK_WORDS), generator=g, dtype=torch.int64)
        t = (lanes * 4 + 1).to(device)  # odd, and wraps like the sums
        _multipliers[device] = t
    return t


def fingerprint(t: Any) -> Any:
    """A 4-element int64 tensor on ``t``'s device that changes whenever any
    byte of ``t`` (contiguous) changes. Nothing is copied to the host and the
    host does not wait: the reduction is queued on the current stream."""
    import torch

    flat = t.reshape(-1).view(torch.uint8)
    n = flat.numel()
    head = n - n % 8
    words = flat[:head].view(torch.int64)
    mult = _table(torch, t.device)
    acc = torch.zeros(4, dtype=torch.int64, device=t.device)
    for b, start in enumerate(range(0, words.numel(), _BLOCK_WORDS)):
        w = words[start : start + _BLOCK_WORDS]
        m = mult[:, : w.numel()]
        # Lane 0 is linear in the words; lane 1 mixes high bits into low ones
        # first, so a change that cancels in one lane does not in the other.
        s0 = (w * m[0]).sum()
        s1 = ((w ^ (w >> 29)) * m[1]).sum()
        k = _to_i64((b * 2 + 1) * 0x9E3779B97F4A7C15)  # block position, odd
        acc[0] += s0 * k
        acc[1] += s1 * k
    if head < n:
        tail = flat[head:].to(torch.int64)
        acc[2] += (tail * mult[0, : tail.numel()]).sum()
    acc[3] = n
    return acc


def device_fingerprint(t: Any, old: Any | None) -> tuple[bool, Any]:
    """(whether ``t`` still matches fingerprint ``old``, its fingerprint now).

    The comparison runs on the device; reading its one boolean waits for the
    queued work to reach it (only for tensors whose version counter says
    unchanged, which is when ``old`` is given)."""
    import torch

    fp = fingerprint(t)
    if old is None:
        return False, fp
    return bool(torch.equal(fp, old)), fp

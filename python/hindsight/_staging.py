"""Device-side helpers of a save: proving a device tensor unchanged without
copying it to the host, and copying the changed ones to the host without
making the training thread wait (`DeviceCopies`).

A skipped tensor must be an unchanged tensor. Torch's version counter misses
`.data` writes, numpy views and shared storages, so it only ever says "it
changed"; "unchanged" needs the whole content. For host memory the engine
fingerprints the bytes (xxh3, in Rust). For device memory, copying to the
host to hash would cost the very transfer a skip is meant to save, so the
fingerprint is a bandwidth-bound reduction computed on the device: only its
4 integers cross to the host. The engine (core ``device_fp``) computes the
same function from the host copy a save makes of a changed tensor, on a
writer thread; so a tensor is fingerprinted on the device only when its
counter says unchanged, at the save after the one that copied it.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

from hindsight import _native
from hindsight._state import tensor_bytes

# Words per block of the reduction: bounds the temporaries (2 x 8 bytes per
# word) whatever the tensor's size. The engine owns it and the multipliers.
_BLOCK_WORDS = _native.DEVICE_FP_BLOCK_WORDS
# Per-device multiplier tables, uploaded once.
_multipliers: dict[Any, Any] = {}
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # the engine's block weights: (2b + 1) x this


def _to_i64(u: int) -> int:
    u &= _MASK64
    return u - (1 << 64) if u >= 1 << 63 else u


def _table(torch: Any, device: Any) -> Any:
    """The engine's two lanes of odd 64-bit multipliers, one per word
    position in a block, on ``device``. Built and uploaded once (64 MiB,
    about 0.2 s on an H200 host): ``DeviceCopies.prepare`` does it on its
    background thread, so a save does not."""
    t = _multipliers.get(device)
    if t is None:
        host = torch.frombuffer(_native.device_fingerprint_table(), dtype=torch.int64)
        # On a stream of its own, finished before it is published: the
        # training thread's streams never wait for this upload.
        side = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            t = host.view(2, _BLOCK_WORDS).to(device, non_blocking=False)
        if side is not None:
            side.synchronize()
        _multipliers.setdefault(device, t)
    return _multipliers[device]


def fingerprint(t: Any) -> Any:
    """A 4-element int64 tensor on ``t``'s device that changes whenever any
    byte of ``t`` (contiguous) changes: core ``device_fp``'s function, equal
    to ``_native.device_fingerprint_of`` over the same bytes. Nothing is
    copied to the host and the host does not wait: the reduction is queued
    on the current stream."""
    import torch

    flat = t.reshape(-1).view(torch.uint8)
    if flat.data_ptr() % 8:
        flat = flat.clone()  # a view at an odd offset cannot be read as 64-bit words
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
        k = _to_i64((b * 2 + 1) * _GOLDEN)  # block position, odd
        acc[0] += s0 * k
        acc[1] += s1 * k
    if head < n:
        tail = flat[head:].to(torch.int64)
        acc[2] += (tail * mult[0, : tail.numel()]).sum()
    acc[3].fill_(n)  # a kernel argument: `acc[3] = n` copies from the host, and waits
    return acc


def device_fingerprints(ts: list[Any]) -> list[list[int]]:
    """Each tensor's fingerprint, read back to the host once per device
    (each read waits for the queued work to reach it): asked, before the
    save enqueues its copies, for the tensors whose version counter says
    unchanged, to compare with the fingerprints of their last saved copies."""
    import torch

    accs = [fingerprint(t) for t in ts]
    by_device: dict[Any, list[int]] = {}
    for i, t in enumerate(ts):
        by_device.setdefault(t.device, []).append(i)
    out: list[list[int]] = [[] for _ in ts]
    for idx in by_device.values():
        rows = torch.stack([accs[i] for i in idx]).tolist()
        for i, row in zip(idx, rows, strict=True):
            out[i] = [int(v) for v in row]
    return out


# -- device-to-host copies of a save ---------------------------------------

_ALIGN = 4096  # regions start on page boundaries


class _CopyDone:
    """The waiter a save lends with its device copies: the engine's writer
    calls it (once) before reading the bytes. It waits on the copies' event,
    never on the whole device."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event: Any = None

    def __call__(self) -> None:
        if self.event is None:
            raise RuntimeError("hindsight: a device copy was never enqueued (a bug)")
        self.event.synchronize()


@dataclass
class _Span:
    """A region of the arena and the save using it (None while it is built)."""

    start: int
    end: int
    handle: Any = None


class _Arena:
    """Pinned host memory a store owns and reuses for the device copies of
    its saves: a ring of page-aligned regions, each free again once the save
    that used it is durable. Pinned by registering ordinary memory
    (``cudaHostRegister`` of 8 GiB took 0.47 s on an H100 host,
    ``cudaHostAlloc`` 5.5 s), falling back to torch's pinned allocator where
    registration is refused."""

    def __init__(self, torch: Any, nbytes: int) -> None:
        nbytes = _aligned(nbytes)
        self.cap = nbytes
        self.registered = False
        raw = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
        skew = -raw.data_ptr() % _ALIGN  # torch aligns to 64 bytes; regions want pages
        buf = raw[skew : skew + nbytes]
        try:
            cudart = torch.cuda.cudart()
            # 1 = cudaHostRegisterPortable: usable from every device.
            torch.cuda.check_error(cudart.cudaHostRegister(buf.data_ptr(), nbytes, 1))
            self.registered = True
        except (RuntimeError, AttributeError):  # refused, or a torch without it
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.buf = buf
        # Live regions in ring order.
        self.spans: deque[_Span] = deque()
        if self.registered:
            # Not at exit: copies may still be in flight then, and the
            # process is ending anyway.
            weakref.finalize(self, _unregister, torch, buf.data_ptr()).atexit = False

    def _fit(self, n: int) -> int | None:
        if not self.spans:
            return 0
        first, last = self.spans[0].start, self.spans[-1]
        if last.start >= first:  # not wrapped: free at the end, then at the start
            if self.cap - last.end >= n:
                return last.end
            return 0 if first >= n else None
        return last.end if first - last.end >= n else None

    def alloc(self, n: int) -> int | None:
        """Offset of a free region of ``n`` bytes, waiting for earlier saves
        to become durable if needed; None if it cannot fit beside the save
        being built (which the caller then copies the slow way)."""
        n = _aligned(n)
        if n > self.cap:
            return None
        while True:
            self.reclaim()
            off = self._fit(n)
            if off is not None:
                self.spans.append(_Span(off, off + n))
                return off
            oldest = self.spans[0].handle if self.spans else None
            if oldest is None:
                return None
            # Back-pressure: saves come faster than storage takes them. A
            # failure of that save is raised here, at the next call.
            oldest.wait()

    def reclaim(self) -> None:
        """Free the regions of saves that are durable (or failed)."""
        while self.spans and self.spans[0].handle is not None and self.spans[0].handle.done():
            self.spans.popleft()

    def assign(self, handle: Any) -> None:
        for s in self.spans:
            if s.handle is None:
                s.handle = handle

    def release_unassigned(self) -> None:
        self.spans = deque(s for s in self.spans if s.handle is not None)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _unregister(torch: Any, ptr: int) -> None:
    with contextlib.suppress(RuntimeError, AttributeError):
        torch.cuda.cudart().cudaHostUnregister(ptr)


def cuda_nbytes(tree: Any) -> int:
    """Arena bytes the CUDA tensors of a state tree need (each region rounded to a page)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0  # no CUDA tensor can exist yet
    return tensor_bytes(tree, "cuda", align=_ALIGN)


class DeviceCopies:
    """The device side of a store's saves.

    A CUDA tensor is copied once, on a side stream ordered after the stream
    that produced it, straight into the store's pinned arena, which the
    engine then writes from without a second copy. ``save`` returns once the
    copies are enqueued; the compute stream waits for them on the device,
    so an in-place update issued after ``save`` returns cannot reach the
    snapshot, and the host never waits. Work on streams other than the
    current one is not ordered with the copies (as for ``torch.save``).

    One-time set-up (pinning the arena) runs on a background thread, started
    by ``prepare`` or by the first save, and is reported apart from the
    steady cost, which the adaptive policy prices. A state that outgrows the
    arena gets a larger one, pinned in the background and swapped in once
    the old one is idle; meanwhile the excess is copied the plain way."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._arena: _Arena | None = None
        self._next: _Arena | None = None
        self._pending: threading.Thread | None = None
        self._want = 0  # bytes asked for while an arena was being pinned
        self._failed = False
        self._streams: dict[Any, Any] = {}
        # Per save being built: device -> waiter, and the set-up time paid.
        self._devices: dict[Any, _CopyDone] = {}
        self.setup_seconds = 0.0

    def prepare(self, nbytes: int) -> None:
        """Start pinning an arena for ``nbytes`` of CUDA state in the
        background (with room for the state to grow by an eighth: loop
        variables and gradients come and go between saves), and building
        the device fingerprint's table for the caller's device."""
        size = min(_aligned(nbytes + nbytes // 8), _aligned(self.limit))
        if self._failed or size <= 0:
            return
        if self._pending is not None:
            # The state outgrew the arena being pinned: a larger one is
            # started once that one is taken (`_swap`).
            self._want = max(self._want, nbytes)
            return
        if any(a is not None and nbytes <= a.cap for a in (self._arena, self._next)):
            return
        import torch

        device = torch.device("cuda", torch.cuda.current_device())

        def build() -> None:
            try:
                self._next = _Arena(torch, size)
            except (RuntimeError, MemoryError) as e:
                # Saves still work, copying the plain way (they block).
                self._failed = True
                sys.stderr.write(
                    f"hindsight: could not pin {size} bytes of host memory ({e}); CUDA tensors "
                    "are copied without it, and saves wait for the copy\n"
                )
            # Ahead of the first save that proves a tensor unchanged (a
            # failure here is met again, and raised, by that save).
            with contextlib.suppress(RuntimeError, MemoryError):
                _table(torch, device)

        self._pending = threading.Thread(target=build, name="hindsight-pin", daemon=True)
        self._pending.start()

    def _swap(self, wait: bool) -> None:
        """Take a newly pinned arena once it is built (waiting for it if
        ``wait``: set-up time) and the old one has no save in flight; then
        start a larger one if a save outgrew it meanwhile."""
        if self._pending is not None:
            if not wait and self._pending.is_alive():
                return
            t0 = time.perf_counter()
            self._pending.join()
            self.setup_seconds += time.perf_counter() - t0
            self._pending = None
        if self._next is not None:
            if self._arena is not None:
                self._arena.reclaim()
                if self._arena.spans:
                    return  # copies may still be landing in it
            self._arena, self._next = self._next, None
        want, self._want = self._want, 0
        if want:
            self.prepare(want)

    def wait_prepared(self) -> None:
        """Block until the arena being pinned is ready (and swapped in when the old one is idle)."""
        self._swap(wait=True)

    def begin(self, state: Any) -> None:
        self._devices = {}
        self.setup_seconds = 0.0
        need = cuda_nbytes(state)
        if need and not self._failed:
            self.prepare(need)
            # The first arena is waited for (set-up); a larger one is taken
            # when it is ready.
            self._swap(wait=self._arena is None)

    def copy(self, t: Any) -> tuple[int, Any, Any]:
        """Enqueue the copy of device tensor ``t``; (host pointer, owner, waiter)."""
        import torch

        arena = self._arena if t.device.type == "cuda" else None
        n = t.numel() * t.element_size()
        off = arena.alloc(n) if arena is not None else None
        if arena is None or off is None:
            # Not CUDA, or no room beside this save: a plain copy, which
            # blocks. Raise staging_bytes to avoid it.
            host = t.to("cpu")
            return host.data_ptr(), host, None
        dev = t.device
        side = self._streams.get(dev)
        if side is None:
            side = self._streams[dev] = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
        done = self._devices.get(dev)
        if done is None:
            done = self._devices[dev] = _CopyDone()
        # Every time: `t` may have just been made contiguous on the compute stream.
        side.wait_stream(torch.cuda.current_stream(dev))
        region = arena.buf[off : off + n]
        with torch.cuda.stream(side):
            region.copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
        t.record_stream(side)
        return region.data_ptr(), region, done

    def end(self) -> None:
        """After the last copy of a save: mark each device's copies with an
        event, and make its compute stream wait for them (on the device)."""
        if not self._devices:
            return
        import torch

        for dev, done in self._devices.items():
            # A blocking event: the writer thread that waits on it sleeps
            # instead of spinning a core.
            ev = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            ev.record(self._streams[dev])
            torch.cuda.current_stream(dev).wait_event(ev)
            done.event = ev

    def saved(self, handle: Any | None) -> None:
        """The save was handed to the engine (``handle``) or failed (None)."""
        if self._arena is None:
            return
        if handle is not None:
            self._arena.assign(handle)
            return
        # Copies already enqueued may still land: let them, before the
        # regions go to another save (possibly on another device's stream).
        for done in self._devices.values():
            if done.event is not None:
                done.event.synchronize()
        for dev in self._devices:
            self._streams[dev].synchronize()
        self._arena.release_unassigned()

"""A skipped tensor must be an unchanged tensor.

`skip_unchanged` (the default) lets a save reuse the previous save's bytes
for a tensor. Torch's version counter misses many writes that training code
makes every day; each pattern here bypasses it, and each must still reach
the checkpoint. The same patterns run on CUDA (marker `cuda`), where the
proof is computed on the device.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import hindsight as hs
from hindsight import _native, _staging

N = 256 * 1024  # 1 MiB of float32: well above the size below which tensors are always copied

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _bypass_dot_data(t: torch.Tensor) -> None:
    t.data.view(-1)[12345] += 1.0


def _bypass_first_and_last(t: torch.Tensor) -> None:
    flat = t.data.view(-1)
    flat[0] = -flat[0] - 1.0
    flat[-1] = flat[-1] + 0.5


def _bypass_shared_storage(t: torch.Tensor) -> None:
    # A second tensor over the same storage has its own version counter.
    alias = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, t.shape)
    alias.view(-1)[777] = 42.0


def _bypass_dlpack(t: torch.Tensor) -> None:
    alias = torch.utils.dlpack.from_dlpack(t.detach())
    alias.view(-1)[999] *= -3.0


def _bypass_ema(t: torch.Tensor) -> None:
    # The usual EMA of weights, written through `.data`.
    src = torch.full_like(t, 2.0)
    t.data.mul_(0.999).add_(src, alpha=0.001)


def _bypass_tiny_change(t: torch.Tensor) -> None:
    # One ulp in one element: nothing a sampled fingerprint would see.
    flat = t.data.view(-1)
    flat[N // 2 + 3] = torch.nextafter(flat[N // 2 + 3], torch.tensor(float("inf"), device=t.device))


PATTERNS = {
    "dot_data": _bypass_dot_data,
    "first_and_last": _bypass_first_and_last,
    "shared_storage": _bypass_shared_storage,
    "dlpack": _bypass_dlpack,
    "ema": _bypass_ema,
    "one_ulp": _bypass_tiny_change,
}


@pytest.fixture
def store(store_dir):
    s = hs.Store(store_dir)
    yield s
    s.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_write_that_bypasses_the_version_counter_is_saved(store, device, pattern):
    p = torch.nn.Parameter(torch.randn(N, device=device))
    frozen = torch.randn(N, device=device)
    store.save("a", {"p": p, "frozen": frozen}).wait()
    before = p.detach().clone()
    version = p._version
    PATTERNS[pattern](p)
    assert p._version == version, "the pattern must bypass the version counter"
    assert not torch.equal(p.detach(), before)
    stats = store.save("b", {"p": p, "frozen": frozen}).wait()
    got = store.load("b", map_location=device)
    assert torch.equal(got["p"], p.detach()), "the checkpoint holds stale weights"
    assert torch.equal(store.load("a", map_location=device)["p"], before)
    # The untouched tensor is still proven unchanged and not copied again.
    assert stats["bytes_reused"] == frozen.numel() * 4
    assert torch.equal(got["frozen"], frozen)


def test_numpy_view_write_is_saved(store):
    t = torch.randn(512, 512)
    store.save("a", {"t": t}).wait()
    np.asarray(t)[5, 5] += 1.0  # numpy writes never touch torch's counter
    store.save("b", {"t": t}).wait()
    assert torch.equal(store.load("b")["t"], t)


def test_from_numpy_buffer_write_is_saved(store):
    a = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    t = torch.from_numpy(a)
    store.save("a", {"t": t}).wait()
    a[100:110, 7] = 0.0
    store.save("b", {"t": t}).wait()
    assert torch.equal(store.load("b")["t"], torch.from_numpy(a.copy()))


@pytest.mark.parametrize("how", ["set_", "assign_data"])
def test_set_to_another_storage_is_saved(store, how):
    p = torch.nn.Parameter(torch.zeros(N))
    store.save("a", {"p": p}).wait()
    if how == "set_":
        with torch.no_grad():
            p.set_(torch.ones(N))
    else:
        p.data = torch.ones(N)  # swaps the storage; the counter stays
    assert torch.equal(p.detach(), torch.ones(N))
    store.save("b", {"p": p}).wait()
    assert torch.equal(store.load("b")["p"], torch.ones(N))


def test_storage_shared_by_two_saved_tensors(store):
    base = torch.zeros(2 * N)
    first, second = base[:N], base[N:]
    store.save("a", {"first": first, "second": second}).wait()
    base.data[N + 5] = 1.0  # written through `.data` of the base: neither view's counter moves
    store.save("b", {"first": first, "second": second}).wait()
    got = store.load("b")
    assert torch.equal(got["second"], second) and got["second"][5] == 1.0
    assert torch.equal(got["first"], first)


def test_unchanged_tensors_are_still_skipped_and_round_trip(store):
    state = {f"w{i}": torch.randn(N) for i in range(4)}
    first = store.save("a", state).wait()
    assert first["bytes_reused"] == 0
    again = store.save("b", state).wait()
    assert again["bytes_reused"] == 4 * N * 4 and again["bytes_staged"] == 0
    got = store.load("b")
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_every_save_is_proven_not_only_the_next(store):
    """A tensor reused once must be checked again at the save after."""
    p = torch.randn(N)
    store.save("a", {"p": p}).wait()
    store.save("b", {"p": p}).wait()  # reused
    p.data[3] = 123.0
    store.save("c", {"p": p}).wait()
    store.save("d", {"p": p}).wait()
    for name in "cd":
        assert store.load(name)["p"][3] == 123.0
    assert store.load("b")["p"][3] != 123.0


# -- the device path, run on CPU tensors ------------------------------------------


class _AsDevice:
    """hindsight._store's view of `_native`, with every tensor described as
    device memory: its copy is lent to the writer, which sums its device
    fingerprint; an unchanged one is fingerprinted "on the device" (torch's
    CPU kernels) and compared. The logic CUDA runs, on any machine."""

    def __getattr__(self, name: str) -> object:
        return getattr(_native, name)

    @staticmethod
    def ArrayView(**kw: object) -> object:  # the class it stands in for
        return _native.ArrayView(**{**kw, "host": False})


@pytest.fixture
def device_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from hindsight import _store

    monkeypatch.setattr(_store, "_native", _AsDevice())


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_device_path_proves_unchanged_tensors_from_the_writers_sums(store_dir, device_path, pattern):
    store = hs.Store(store_dir, chunk_size=1 << 16)  # a tensor spans many chunks, summed apart
    p = torch.nn.Parameter(torch.randn(N))
    frozen = torch.randn(N + 3)  # bytes not a multiple of 8 words: a tail
    first = store.save("a", {"p": p, "frozen": frozen}).wait()
    assert first["bytes_reused"] == 0
    before = p.detach().clone()
    PATTERNS[pattern](p)  # bypasses the version counter
    stats = store.save("b", {"p": p, "frozen": frozen}).wait()
    assert stats["bytes_reused"] == frozen.numel() * 4, "the untouched tensor is proven unchanged"
    got = store.load("b")
    assert torch.equal(got["p"], p.detach()), "the checkpoint holds stale weights"
    assert torch.equal(got["frozen"], frozen)
    assert torch.equal(store.load("a")["p"], before)
    # Nothing touched since: both reused, and a changed one is copied again.
    again = store.save("c", {"p": p, "frozen": frozen}).wait()
    assert again["bytes_reused"] == (p.numel() + frozen.numel()) * 4
    with torch.no_grad():
        p.mul_(2.0)  # through the counter
    last = store.save("d", {"p": p, "frozen": frozen}).wait()
    assert last["bytes_reused"] == frozen.numel() * 4
    assert torch.equal(store.load("d")["p"], p.detach())
    store.close()


# -- the device fingerprint, exercised on the CPU (same code on CUDA) ----------


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.complex64]
)
def test_device_fingerprint_sees_any_single_element_change(dtype):
    g = torch.Generator().manual_seed(1)
    t = (torch.randn(4099, generator=g) * 10).to(dtype)  # 4099: bytes not a multiple of 8
    fp = _staging.fingerprint(t)
    assert torch.equal(fp, _staging.fingerprint(t.clone())), "deterministic"
    for i in [0, 1, 7, 8, 2048, 4097, 4098]:
        u = t.clone()
        u[i] = (~u[i]) if dtype == torch.bool else u[i] + 1
        assert not torch.equal(fp, _staging.fingerprint(u)), f"missed a change at {i}"


def test_device_fingerprint_sees_swaps_and_spans_blocks():
    t = torch.arange(3 * _staging._BLOCK_WORDS, dtype=torch.float64)  # spans three blocks
    fp = _staging.fingerprint(t)
    u = t.clone()
    u[[10, 11]] = u[[11, 10]]
    assert not torch.equal(fp, _staging.fingerprint(u))
    v = t.clone()
    v[_staging._BLOCK_WORDS :] = t[: 2 * _staging._BLOCK_WORDS].clone()  # a block moved
    assert not torch.equal(fp, _staging.fingerprint(v))
    assert _staging.device_fingerprints([t, u]) == [fp.tolist(), _staging.fingerprint(u).tolist()]


@pytest.mark.parametrize(
    ("dtype", "numel", "offset"),
    [
        (torch.float32, 0, 0),
        (torch.uint8, 5, 0),  # only trailing bytes
        (torch.float32, 4099, 0),  # a tail of 4 bytes
        (torch.bfloat16, 1 << 16, 3),  # a view at an odd byte offset
        (torch.float64, 2 * _staging._BLOCK_WORDS + 17, 0),  # three blocks, the last short
        (torch.int8, 8 * _staging._BLOCK_WORDS + 3, 1),  # one full block and a tail, unaligned
    ],
)
def test_the_engine_computes_the_device_fingerprint_from_the_host_copy(dtype, numel, offset):
    """A save proves a device tensor unchanged by comparing what the device
    computes now with what a writer thread computed from the copy of the
    last save: the two must be one function, bit for bit."""
    g = torch.Generator().manual_seed(numel)
    base = torch.randint(-100, 100, (numel + offset,), generator=g).to(dtype)
    t = base[offset:]
    [on_device] = _staging.device_fingerprints([t])  # the torch reductions (here on the CPU)
    host = _native.device_fingerprint_of(t.contiguous().view(torch.uint8).numpy())
    assert list(host) == on_device
    assert on_device[3] == numel * t.element_size()


def test_one_time_setup_is_reported_apart_from_the_steady_cost(tmp_path: Path) -> None:
    # The adaptive policy prices a checkpoint at its steady cost: the first
    # save's fresh staging memory is set-up, later saves reuse it.
    store = hs.Store(tmp_path / "s", chunk_size=1 << 20)
    first = store.save("a", {"w": torch.randn(4 << 18)})  # 4 full 1 MiB blocks
    assert first.setup_seconds > 0 and store.last_setup_seconds >= first.setup_seconds
    first.wait()
    second = store.save("b", {"w": torch.randn(4 << 18)})  # new content, same size
    assert second.setup_seconds == 0.0 and store.last_setup_seconds == 0.0
    stats = second.wait()
    assert stats is not None and stats["setup_seconds"] == 0.0 and stats["bytes_staged"] == 4 << 20


def test_the_background_cpu_of_saves_is_counted(tmp_path: Path) -> None:
    # What the adaptive policy adds to a checkpoint's price beside the
    # caller's time: the writer threads' hashing and writing.
    store = hs.Store(tmp_path / "s")
    assert store.background_cpu_seconds == 0.0
    store.save("a", {"w": torch.randn(4 << 20)}).wait()
    after_one = store.background_cpu_seconds
    assert after_one > 0.0
    store.save("b", {"w": torch.randn(4 << 20)}).wait()
    assert store.background_cpu_seconds > after_one

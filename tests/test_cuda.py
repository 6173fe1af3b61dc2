"""The GPU checkpoint path (marker `cuda`; skipped where torch sees no GPU).

A save of CUDA tensors copies them on a side stream straight into the
store's pinned arena and returns without waiting for the copy; the writer
waits on the copy's event. These tests pin down what a user relies on:
bit-exact round trips of every dtype, a snapshot that in-place updates
issued right after `save` cannot reach, many saves in flight reusing the
arena, and every `map_location` form. The stale-write patterns run on CUDA
in test_unchanged.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hindsight as hs
from test_roundtrip import ALL_DTYPES, random_tensor, same_bits

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exact_from_cuda(store_dir, dtype):
    gen = torch.Generator().manual_seed(2)
    shapes = [(), (0,), (1,), (7,), (5, 3), (2, 3, 4), (3000,), (1 << 18,)]
    host = {str(s): random_tensor(dtype, s, gen) for s in shapes}
    state = {k: v.cuda() for k, v in host.items()}
    store = hs.Store(store_dir, chunk_size=4096)
    store.save("x", state).wait()
    back = store.load("x")
    for k, v in host.items():
        assert back[k].device.type == "cpu"
        assert same_bits(v, back[k]), (dtype, k)
    on_gpu = store.load("x", map_location="cuda")
    for k, v in host.items():
        assert on_gpu[k].device.type == "cuda"
        assert same_bits(v, on_gpu[k].cpu()), (dtype, k)


def test_snapshot_is_not_reached_by_in_place_updates_issued_right_after_save(store_dir):
    # Large enough that the copy is still running when the updates are queued.
    torch.manual_seed(0)
    ws = [torch.randn(64 << 20, device="cuda") for _ in range(2)]  # 2 x 256 MiB
    expected = [w.cpu() for w in ws]
    store = hs.Store(store_dir)
    h = store.save("snap", {"w": ws}, skip_unchanged=False)
    for w in ws:  # on the compute stream, at once
        w.mul_(-3.0).add_(1.0)
    h.wait()
    got = store.load("snap")["w"]
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
    torch.cuda.synchronize()
    assert torch.equal(ws[0].cpu(), expected[0] * -3.0 + 1.0)


def test_many_saves_in_flight_each_hold_their_own_values(store_dir):
    # An arena for three saves: the ring wraps, and a save waits for an
    # earlier one only when it is full.
    w = torch.zeros(8 << 20, device="cuda")  # 32 MiB
    store = hs.Store(store_dir, staging_bytes=96 << 20)
    store.prepare({"three saves": [w, w, w]})
    handles = []
    for i in range(8):
        w.fill_(float(i))
        handles.append(store.save(f"s{i}", {"w": w}))
        w.add_(0.5)  # must not reach save i
    for h in handles:
        h.wait()
    for i in range(8):
        got = store.load(f"s{i}")["w"]
        assert torch.equal(got, torch.full_like(got, float(i))), i


def test_tensors_made_contiguous_for_the_save_are_copied_after_that(store_dir):
    torch.manual_seed(3)
    conv = torch.randn(64, 32, 3, 3, device="cuda").to(memory_format=torch.channels_last)
    t = torch.randn(2048, 1024, device="cuda").t()  # transposed: not contiguous
    big = torch.randn(1 << 22, device="cuda")
    store = hs.Store(store_dir)
    state = {"big": big, "conv": conv, "t": t}
    store.save("nc", state).wait()
    got = store.load("nc")
    for k, v in state.items():
        assert torch.equal(got[k], v.cpu()), k


def test_views_at_odd_byte_offsets_are_saved_and_proven_unchanged(store_dir):
    base = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    view = base[3:]  # contiguous, not 8-byte aligned
    store = hs.Store(store_dir)
    store.save("a", {"v": view}).wait()
    store.save("b", {"v": view}).wait()  # unchanged: fingerprinted on the device, not copied
    before = view.cpu()
    view[5] += 1
    store.save("c", {"v": view}).wait()
    assert torch.equal(store.load("b")["v"], before)
    assert torch.equal(store.load("c")["v"], view.cpu())


def test_a_state_larger_than_the_staging_budget_is_still_saved_exactly(store_dir):
    torch.manual_seed(1)
    big = torch.randn(16 << 20, device="cuda")  # 64 MiB against a 16 MiB budget
    small = torch.randn(1000, device="cuda")
    store = hs.Store(store_dir, staging_bytes=16 << 20)
    store.save("b", {"big": big, "small": small}).wait()
    got = store.load("b")
    assert torch.equal(got["big"], big.cpu()) and torch.equal(got["small"], small.cpu())


def test_map_location_variants(store_dir):
    store = hs.Store(store_dir)
    w = torch.arange(12.0, device="cuda").reshape(3, 4)
    store.save("m", {"w": w, "c": torch.ones(2)}).wait()
    assert store.load("m")["w"].device.type == "cpu"
    assert store.load("m", map_location="cuda")["w"].device.type == "cuda"
    assert store.load("m", map_location=torch.device("cuda:0"))["w"].device == torch.device("cuda:0")
    by_dict = store.load("m", map_location={"cuda:0": "cpu", "cpu": "cuda:0"})
    assert by_dict["w"].device.type == "cpu" and by_dict["c"].device.type == "cuda"
    seen: list[str] = []
    got = store.load("m", map_location=lambda t, dev: seen.append(dev) or t.to("cuda"))
    assert sorted(seen) == ["cpu", "cuda:0"]
    assert torch.equal(got["w"].cpu(), w.cpu())


def test_checkpointing_a_cuda_model_resumes_bit_exact(store_dir):
    torch.manual_seed(0)
    net = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device="cuda")
    net(x).square().mean().backward()
    opt.step()
    store = hs.Store(store_dir)
    store.prepare({"model": net.state_dict(), "optim": opt.state_dict()})
    store.save("c", {"model": net.state_dict(), "optim": opt.state_dict()})
    ref = {k: v.cpu() for k, v in net.state_dict().items()}
    opt.zero_grad()
    net(x).square().mean().backward()
    opt.step()  # in place, right after the save returned
    store.flush()
    got = store.load("c", map_location="cuda")
    net.load_state_dict(got["model"])
    for k, v in ref.items():
        assert torch.equal(net.state_dict()[k].cpu(), v), k


def test_a_live_cuda_state_is_compared_with_its_checkpoint(store_dir):
    """A replay worker proves the state it computed is the recording's
    (`Store.check_state`): CUDA tensors are copied to the host for it. It
    failed with an internal error on any CUDA tensor."""
    torch.manual_seed(3)
    state = {"w": torch.randn(1000, device="cuda"), "b": torch.randn(7, device="cuda"), "n": 4}
    store = hs.Store(store_dir, chunk_size=1024)
    store.save("c", state).wait()
    assert store.check_state("c", state).first is None
    state["w"][999] += 1
    first = store.check_state("c", state).first
    assert first is not None and first.path == "w", first


def test_a_state_that_outgrew_its_prepared_arena_saves_without_blocking_copies(store_dir):
    """`hs.checkpointing` pins an arena for the model and optimizer after the
    first step; a save also holds the gradients and the steps' variables.
    The arena grows to hold them by the next save (on an H200 the first
    recording's saves copied 104 MiB the blocking way, 150-320 ms each)."""
    from hindsight import _staging

    plain: list[int] = []
    copy = _staging.DeviceCopies.copy

    def counted(self: Any, t: Any) -> Any:
        out = copy(self, t)
        if out[2] is None:
            plain.append(t.numel())
        return out

    torch.manual_seed(4)
    model = [torch.randn(1 << 20, device="cuda") for _ in range(4)]
    grads = [torch.randn(1 << 20, device="cuda") for _ in range(4)]
    store = hs.Store(store_dir)
    store.prepare({"model": model})  # as hs.checkpointing does: in the background
    _staging.DeviceCopies.copy = counted  # type: ignore[method-assign]
    try:
        for i in range(3):
            store.save(f"s{i}", {"model": model, "grads": grads}).wait()
            if i == 0:
                store._copies.wait_prepared()  # the larger arena, pinned in the background
                seen_first = len(plain)
    finally:
        _staging.DeviceCopies.copy = copy  # type: ignore[method-assign]
    assert seen_first > 0  # the first save outgrew the prepared arena
    assert len(plain) == seen_first, "later saves still copied the blocking way"
    for i in range(3):
        assert torch.equal(store.load(f"s{i}")["grads"][3], grads[3].cpu())

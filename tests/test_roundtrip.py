"""Bit-exact round trips of real training state, every dtype, partial loads."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import hindsight as hs

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    # Random bytes reinterpreted: covers NaN payloads, subnormals, every bit pattern.
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))) if a.numel() else True


def trained_model_and_optimizer() -> tuple[
    torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler
]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 6 * 6, 10),
    )
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8)
        loss = net(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return net, opt, sched


def test_model_optimizer_scheduler_round_trip_bit_exact(store_dir):
    net, opt, sched = trained_model_and_optimizer()
    store = hs.Store(store_dir)
    state = {"model": net.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(), "epoch": 3}
    store.save("epoch-3", state).wait()
    loaded = hs.Store(store_dir).load("epoch-3")

    assert set(loaded["model"]) == set(state["model"])
    for k, v in state["model"].items():
        assert same_bits(v, loaded["model"][k]), k
    # Optimizer state keeps integer parameter ids as keys and tuples (betas) as tuples.
    assert loaded["optim"]["param_groups"] == state["optim"]["param_groups"]
    for pid, st in state["optim"]["state"].items():
        for name, value in st.items():
            assert same_bits(value, loaded["optim"]["state"][pid][name]), (pid, name)
    assert loaded["sched"] == state["sched"]
    assert loaded["epoch"] == 3

    # The result feeds load_state_dict directly and training continues identically.
    net2, opt2, _ = trained_model_and_optimizer()
    net2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optim"])
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    for n, o in ((net, opt), (net2, opt2)):
        o.zero_grad()
        n(x).sum().backward()
        o.step()
    for a, b in zip(net.state_dict().values(), net2.state_dict().values(), strict=True):
        assert same_bits(a, b)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_and_shape(store_dir, dtype):
    gen = torch.Generator().manual_seed(1)
    shapes = [(), (0,), (3, 0, 2), (1,), (7,), (5, 3), (2, 3, 4)]
    state = {str(s): random_tensor(dtype, s, gen) for s in shapes}
    store = hs.Store(store_dir, chunk_size=4096)
    big = random_tensor(dtype, (3000,), gen)  # spans several 4 KiB chunks for wide dtypes
    state["big"] = big
    store.save("x", state).wait()
    loaded = store.load("x")
    for k, v in state.items():
        assert same_bits(v, loaded[k]), (dtype, k)
        assert loaded[k].dim() == v.dim()


def test_plain_values_keep_their_types(store_dir):
    state = {
        "none": None,
        "t": True,
        "f": False,
        "i": -7,
        "big": 2**100,
        "neg_big": -(2**70),
        "nan": float("nan"),
        "inf": float("-inf"),
        "s": "héllo \u2603",
        "b": b"\x00\xff",
        "ba": bytearray(b"abc"),
        "list": [1, [2, (3, "x")]],
        "tuple": (1, 2),
        "empty": {},
        "el": [],
        3: "int key",
        2.5: "float key",
        None: "none key",
        (): (),
    }
    store = hs.Store(store_dir)
    store.save("v", state).wait()
    got = store.load("v")
    assert math.isnan(got.pop("nan"))
    state.pop("nan")
    state["ba"] = b"abc"  # bytearray loads as bytes
    assert got == state
    assert type(got["tuple"]) is tuple and type(got["list"][1][1]) is tuple


def test_numpy_arrays_load_as_numpy(store_dir):
    arrays = {
        "f4": np.arange(12, dtype=np.float32).reshape(3, 4),
        "be": np.arange(5, dtype=">i4"),  # big-endian input is stored little-endian
        "bool": np.array([True, False]),
        "c16": np.array([1 + 2j]),
        "scalar0d": np.array(3.5),
        "strided": np.arange(20, dtype=np.int64)[::3],
        "npscalar": np.float32(1.5),
    }
    store = hs.Store(store_dir)
    store.save("n", arrays).wait()
    got = store.load("n")
    for k in ("f4", "bool", "c16", "scalar0d", "strided"):
        assert isinstance(got[k], np.ndarray)
        np.testing.assert_array_equal(got[k], arrays[k])
        assert got[k].dtype == arrays[k].dtype
    np.testing.assert_array_equal(got["be"], arrays["be"])
    assert got["be"].dtype == np.dtype("<i4")
    assert got["npscalar"] == 1.5


def test_partial_load_reads_only_that_subtree(store_dir):
    net, opt, _ = trained_model_and_optimizer()
    store = hs.Store(store_dir)
    store.save("c", {"model": net.state_dict(), "optim": opt.state_dict()}).wait()
    model = store.load("c", path="model")
    assert set(model) == set(net.state_dict())
    w = store.load("c", path=["model", "4.weight"])
    assert same_bits(w, net.state_dict()["4.weight"])
    # Corrupting every optimizer chunk does not affect a load of the model:
    # proof that only the model's chunks are read.
    info = store.info("c")
    assert any(k.startswith("optim/") for k, _, _ in info["entries"])
    with pytest.raises(hs.NotFoundError, match="no/such"):
        store.load("c", path="no/such")


def test_views_noncontiguous_and_conj_tensors(store_dir):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    c = torch.randn(3, dtype=torch.complex64)
    state = {"t": base.t(), "slice": base[1:3, ::2], "conj": c.conj(), "neg": torch._neg_view(base[0])}
    store = hs.Store(store_dir)
    store.save("v", state).wait()
    got = store.load("v")
    for k, v in state.items():
        assert torch.equal(got[k], v.resolve_conj().resolve_neg()), k


def test_map_location(store_dir):
    store = hs.Store(store_dir)
    store.save("m", {"w": torch.ones(3)}).wait()
    assert store.load("m", map_location="cpu")["w"].device.type == "cpu"
    seen = []
    got = store.load("m", map_location=lambda t, dev: seen.append(dev) or t * 2)
    assert seen == ["cpu"] and torch.equal(got["w"], torch.full((3,), 2.0))


def test_loaded_tensors_are_writable_and_independent(store_dir):
    store = hs.Store(store_dir)
    store.save("w", {"w": torch.zeros(4)}).wait()
    a = store.load("w")["w"]
    b = store.load("w")["w"]
    a += 1
    assert torch.equal(b, torch.zeros(4))


def test_names_and_missing_checkpoints(store_dir):
    store = hs.Store(store_dir)
    with pytest.raises(hs.InvalidArgumentError, match="checkpoint name"):
        store.save("../escape", {})
    with pytest.raises(hs.NotFoundError, match="nope"):
        store.load("nope")
    with pytest.raises(hs.NotFoundError, match="store"):
        hs.Store(store_dir.parent / "missing", create=False)
    assert store.list() == []

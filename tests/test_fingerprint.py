"""The batch fingerprint, walked natively: the same parts the Python walk
of earlier releases hashed (their recordings stay comparable), and a batch
that differs anywhere (content, dtype, shape, container, key) differs."""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch

from hindsight import _native
from hindsight._run import batches


def reference(x: Any) -> str:
    """The fingerprint format as the earlier Python walk wrote it."""
    parts: list[Any] = []

    def walk(x: Any, depth: int) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach()
            if t.layout != torch.strided:
                parts.append(f"tensor {t.layout} {t.dtype} {tuple(t.shape)}")
                return
            parts.append(f"tensor {t.dtype} {tuple(t.shape)}")
            flat = t.reshape(-1)
            if flat.numel() * flat.element_size() > 16 << 20:
                flat = flat[:: -(-flat.numel() // (1 << 20))]
            flat = flat.contiguous()
            if flat.numel():
                parts.append(flat.view(torch.uint8).numpy())
        elif isinstance(x, np.ndarray):
            parts.append(f"array {x.dtype} {x.shape}")
            if x.dtype.hasobject:
                parts.append(repr(x.tolist())[:4096])
            elif x.size:
                parts.append(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
        elif x is None or isinstance(x, (bool, int, float, str, bytes)):
            parts.append(f"{type(x).__name__} {x!r}"[:4096])
        elif depth >= 8:
            parts.append(type(x).__qualname__)
        elif isinstance(x, (list, tuple)):
            parts.append(f"{type(x).__qualname__} {len(x)}")
            for v in x:
                walk(v, depth + 1)
        elif isinstance(x, Mapping):
            parts.append(f"{type(x).__qualname__} {len(x)}")
            for k, v in x.items():
                parts.append(str(k))
                walk(v, depth + 1)
        else:
            fields = getattr(x, "__dict__", None)
            parts.append(type(x).__qualname__)
            if isinstance(fields, dict) and len(fields) <= 64:
                walk(fields, depth + 1)

    walk(x, 0)
    return _native.batch_digest(parts)


Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Encoding:
    input_ids: torch.Tensor
    labels: torch.Tensor
    meta: dict[str, Any]


def nested(depth: int) -> Any:
    x: Any = torch.arange(3)
    for _ in range(depth):
        x = [x]
    return x


g = torch.Generator().manual_seed(0)
BATCHES = {
    "pair of tensors": [torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)],
    "scalar tensor": torch.tensor(3.5),
    "empty tensor": torch.zeros(0, 4),
    "bfloat16": torch.randn(4, 4, generator=g).to(torch.bfloat16),
    "requires grad": torch.randn(3, requires_grad=True),
    "parameter": torch.nn.Parameter(torch.randn(2, 2, generator=g)),
    "transposed (not contiguous)": torch.randn(6, 5, generator=g).t(),
    "a view with an offset": torch.arange(100)[10:30],
    "sampled (over 16 MiB)": torch.arange(5 << 20, dtype=torch.float32),
    "sparse": torch.eye(3).to_sparse(),
    "dict batch": {"input_ids": torch.arange(12).view(3, 4), "mask": torch.ones(3, 4, dtype=torch.bool)},
    "namedtuple": Pair(torch.ones(2), np.arange(5, dtype=np.int16)),
    "numpy strided": np.arange(20.0).reshape(4, 5)[:, ::2],
    "numpy objects": np.array(["a", 1, None], dtype=object),
    "scalars": (None, True, 3, 2.5, "text", b"raw", "é" * 5000),
    "dataclass": Encoding(torch.arange(4), torch.arange(4) % 2, {"lengths": [4, 4]}),
    "sampler indices": list(range(8)),
    "deep": nested(12),
}


@pytest.mark.parametrize("name", list(BATCHES))
def test_the_native_walk_hashes_what_the_python_walk_did(name: str) -> None:
    assert batches.digest(BATCHES[name]) == reference(BATCHES[name])


def test_every_difference_changes_the_fingerprint() -> None:
    base = {"x": torch.arange(8, dtype=torch.float32).view(2, 4), "y": [1, 2]}
    variants = [
        {"x": base["x"].clone().index_put_((torch.tensor([1]), torch.tensor([3])), torch.tensor(0.5)), "y": [1, 2]},
        {"x": base["x"].double(), "y": [1, 2]},
        {"x": base["x"].view(4, 2), "y": [1, 2]},
        {"x": base["x"], "y": (1, 2)},
        {"z": base["x"], "y": [1, 2]},
        {"x": base["x"], "y": [1, 3]},
    ]
    prints = {batches.digest(v) for v in variants}
    assert len(prints) == len(variants) and batches.digest(base) not in prints
    assert batches.digest(base) == batches.digest({"x": base["x"].clone(), "y": [1, 2]})


def test_one_printer_walks_every_dtype_and_int_as_the_reference_does() -> None:
    """The walk keeps each dtype's text and element size once met: a batch
    mixing dtypes of the same shape (bytes alike in length or not), walked
    again and in another order, still hashes each tensor as its own dtype;
    ints print as Python writes them, signs and extremes included."""
    dtypes = [
        torch.float32,
        torch.int32,
        torch.int8,
        torch.float64,
        torch.bool,
        torch.float16,
        torch.uint8,
        torch.int64,
    ]
    mixed = [torch.ones(2, 3).to(d) for d in dtypes]
    for batch in (mixed, mixed[::-1], mixed):
        assert batches.digest(batch) == reference(batch)
    assert len({batches.digest(t) for t in mixed}) == len(dtypes)
    ints = [0, -1, 7, -10, 2**63 - 1, -(2**63), 10**18]
    assert batches.digest(ints) == reference(ints)
    assert batches.digest([torch.zeros(5)]) == reference([torch.zeros(5)])  # (5,): a one-tuple


@pytest.mark.fresh_process  # a forked interpreter has torch and numpy loaded
def test_a_framework_imported_after_the_first_step_is_walked_as_one() -> None:
    code = (
        "import sys; from hindsight._run import batches\n"
        "assert 'numpy' not in sys.modules and 'torch' not in sys.modules\n"
        "before = batches.digest([1, 'a'])\n"
        "import numpy as np\n"
        "a = np.arange(6)\n"
        "print(before == batches.digest([1, 'a']), batches.digest(a) != batches.digest(np.arange(1, 7)))\n"
    )
    import subprocess

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True"]

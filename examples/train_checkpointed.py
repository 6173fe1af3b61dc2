"""A real (small) training run checkpointed with hindsight.

Trains a CNN on deterministic synthetic data, checkpointing model, optimizer,
scheduler and RNG state at the end of every epoch in the background. Half-way
it "loses" the process state, resumes from the latest checkpoint, and checks
that the resumed run ends bit-identical to an uninterrupted one. Finally it
prints what the store holds (dedup ratio) and verifies every byte.

    python examples/train_checkpointed.py --store .hindsight/example-store
"""

from __future__ import annotations

import argparse
import random
import shutil
import time

import numpy as np
import torch
from torch import nn

import hindsight as hs


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )
    # A frozen embedding-like block: saved every epoch, stored once.
    net.register_buffer("frozen_table", torch.randn(512, 1024))
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    return net, opt, sched


def data(n: int = 2048) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(42)
    x = torch.randn(n, 1, 28, 28, generator=g)
    y = (x.mean(dim=(1, 2, 3)) * 40).long().clamp(-5, 4) + 5
    return torch.utils.data.TensorDataset(x, y)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])


def train(store: hs.Store | None, epochs: int, start: dict | None = None, stop_after: int | None = None) -> nn.Module:
    net, opt, sched = build(seed=0)
    first = 0
    torch.manual_seed(1)
    if start is not None:
        net.load_state_dict(start["model"])
        opt.load_state_dict(start["optim"])
        sched.load_state_dict(start["sched"])
        set_rng_state(start["rng"])
        first = start["epoch"] + 1
    ds = data()
    for epoch in range(first, epochs):
        loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True)
        t0 = time.perf_counter()
        total = 0.0
        for x, y in loader:
            loss = nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        sched.step()
        blocked = 0.0
        if store is not None:
            t1 = time.perf_counter()
            state = {
                "model": net.state_dict(),
                "optim": opt.state_dict(),
                "sched": sched.state_dict(),
                "rng": rng_state(),
                "epoch": epoch,
            }
            store.save(f"epoch-{epoch:03d}", state, meta={"loss": total / len(loader)})
            blocked = time.perf_counter() - t1
        print(
            f"epoch {epoch:2d}  loss {total / len(loader):.4f}  train {time.perf_counter() - t0:.2f}s"
            f"  save blocked {blocked * 1e3:.1f} ms"
        )
        if stop_after is not None and epoch == stop_after:
            break
    return net


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=".hindsight/example-store")
    ap.add_argument("--epochs", type=int, default=6)
    args = ap.parse_args()
    shutil.rmtree(args.store, ignore_errors=True)
    store = hs.Store(args.store)

    print("== run 1: train, checkpoint every epoch, 'crash' half-way")
    train(store, args.epochs, stop_after=args.epochs // 2 - 1)
    store.flush()
    latest = sorted(store.list())[-1]
    print(f"== run 2: resume from {latest}")

    resumed = train(store, args.epochs, start=store.load(latest))
    store.flush()

    print("== reference: one uninterrupted run")
    reference = train(None, args.epochs)
    same = all(
        torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), reference.state_dict().values(), strict=True)
    )
    print(f"resumed weights bit-identical to uninterrupted run: {same}")

    u = store.usage()
    print(
        f"store: {u['checkpoints']} checkpoints, logical {u['logical_bytes'] / 2**20:.1f} MiB, "
        f"stored {u['stored_bytes'] / 2**20:.1f} MiB (dedup {u['logical_bytes'] / u['stored_bytes']:.2f}x)"
    )
    problems = store.verify()
    print(f"verify: {'all intact' if not problems else problems}")
    if not same or problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

"""One rank of a real `torchrun` job (gloo, CPU) for tests/test_dist.py and
benches/bench_dist.py: trains a small model under DDP or FSDP2, saves and
loads through `hindsight.dist`, and writes what the test compares.

    torchrun --nproc_per_node=N dist_worker.py MODE STORE OUT [STEPS] [SAVE_AT]

MODE: ddp-train (train STEPS, save at SAVE_AT, write final weights),
ddp-resume (load SAVE_AT's checkpoint, train to STEPS), fsdp-train,
fsdp-load (load on this world size, write the whole tensors),
die-mid-save (rank 1 is killed with SIGKILL right after its save starts),
ddp-preempt (DDP with hsd.StopOnSignal: resumes the latest checkpoint,
trains slowly to STEPS; a signal makes every rank save and exit 85).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import hindsight as hs
import hindsight.dist as hsd

MODE, STORE, OUT = sys.argv[1], sys.argv[2], Path(sys.argv[3])
STEPS = int(sys.argv[4]) if len(sys.argv) > 4 else 6
SAVE_AT = int(sys.argv[5]) if len(sys.argv) > 5 else 3


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 5))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)


def train_step(m: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    x, y = batch(step, rank)
    opt.zero_grad()
    torch.nn.functional.mse_loss(m(x), y).backward()
    opt.step()


def full(sd: dict) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in sd.items()}


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)  # per-rank dropout streams
    store = hs.Store(STORE)
    m = model()
    if MODE.startswith("ddp"):
        m = torch.nn.parallel.DistributedDataParallel(m)
    elif MODE.startswith("fsdp") or MODE == "die-mid-save":
        from torch.distributed.fsdp import fully_shard

        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    start = 0
    if MODE == "ddp-preempt":
        preempt(store, m, opt, rank, world)
        return
    if MODE in ("ddp-resume", "fsdp-load"):
        state = {"model": m.state_dict(), "optim": opt.state_dict(), "step": 0}
        if MODE == "fsdp-load":
            # The optimizer's state exists only after a first step: make it.
            train_step(m, opt, 0, rank)
            state = {"model": m.state_dict(), "optim": opt.state_dict(), "step": 0}
        got = hsd.load(store, f"ck-{SAVE_AT}", state)
        m.load_state_dict(got.state["model"])
        opt.load_state_dict(got.state["optim"])
        start = got.state["step"]
        if got.saved_world == world:
            torch.set_rng_state(got.rank_state["rng"])
        else:
            try:
                got.rank_state  # noqa: B018
            except hs.InvalidArgumentError as e:
                (OUT / f"refused-{world}.txt").write_text(str(e))
        whole = full(m.state_dict())  # a collective: every rank
        if rank == 0:
            torch.save({"model": whole, "world": got.saved_world}, OUT / f"loaded-{MODE}-{world}.pt")
    for step in range(start, STEPS):
        if step == SAVE_AT and MODE in ("ddp-train", "fsdp-train", "die-mid-save"):
            state = {"model": m.state_dict(), "optim": opt.state_dict(), "step": step}
            h = hsd.save(store, f"ck-{step}", state, rank_state={"rng": torch.get_rng_state()})
            if MODE == "die-mid-save" and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            h.wait(timeout=120)
            whole = full(m.state_dict())
            if rank == 0:
                torch.save({"model": whole}, OUT / f"at-{step}.pt")
        train_step(m, opt, step, rank)
    whole = full(m.state_dict())
    if rank == 0:
        torch.save({"model": whole}, OUT / f"final-{MODE}-{world}.pt")
    dist.destroy_process_group()


def preempt(store: hs.Store, m: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> None:
    import time

    (OUT / f"pid-{rank}").write_text(str(os.getpid()))
    start = 0
    done = sorted(store.list(), key=lambda n: int(n.split("-")[1]))
    if done:
        got = hsd.load(store, done[-1], {"model": m.state_dict(), "optim": opt.state_dict(), "step": 0})
        m.load_state_dict(got.state["model"])
        opt.load_state_dict(got.state["optim"])
        start = got.state["step"]
        torch.set_rng_state(got.rank_state["rng"])
        (OUT / f"resumed-{rank}").write_text(str(start))
    with hsd.StopOnSignal() as stop:
        for step in range(start, STEPS):
            if stop.agreed():
                state = {"model": m.state_dict(), "optim": opt.state_dict(), "step": step}
                hsd.save(store, f"ck-{step}", state, rank_state={"rng": torch.get_rng_state()}).wait(timeout=60)
                stop.leave(f"ck-{step}")
            train_step(m, opt, step, rank)
            time.sleep(0.1)
    whole = full(m.state_dict())
    if rank == 0:
        torch.save({"model": whole}, OUT / f"final-{MODE}-{world}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

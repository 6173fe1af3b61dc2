"""Multi-rank checkpoints on CPU (gloo), one run: hindsight.dist against
torch.distributed.checkpoint (DCP) on the same FSDP2-sharded state, for 2
and 4 ranks: save blocked time, time to durable, bytes each rank writes,
load on the same world size and on another (resharding), and the cost of a
one-flag all_reduce per step (what agreeing on a stop step costs).

    make bench-dist            # python benches/bench_dist.py [--mib 64]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchutil import fmt_b, fmt_s


def worker(mib: int, root: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    import hindsight as hs
    import hindsight.dist as hsd

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    width = 1024
    layers = max(1, (mib << 20) // (width * width * 4))
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in m:
        fully_shard(layer)
    fully_shard(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(4, width)).sum().backward()
    opt.step()
    res: dict[str, list[float]] = {}

    def timed(key: str, f) -> object:
        dist.barrier()
        t = time.perf_counter()
        r = f()
        res.setdefault(key, []).append(time.perf_counter() - t)
        return r

    def state() -> dict:
        return {"model": m.state_dict(), "optim": opt.state_dict()}

    store = hs.Store(root / f"hs-{world}")
    written = 0
    for i in range(3):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1e-3)  # every save writes new bytes
        h = timed("hs_blocked", lambda i=i: hsd.save(store, f"ck-{i}", state()))
        timed("hs_durable", h.wait)
        written = h.nbytes
        fut = timed(
            "dcp_async_blocked", lambda i=i: dcp.async_save(state(), checkpoint_id=str(root / f"dcp-async-{world}-{i}"))
        )
        timed("dcp_async_durable", fut.result)
        timed("dcp_save", lambda i=i: dcp.save(state(), checkpoint_id=str(root / f"dcp-{world}-{i}")))
    timed("hs_load", lambda: hsd.load(store, "ck-2", state()))
    timed("dcp_load", lambda: dcp.load(state(), checkpoint_id=str(root / f"dcp-{world}-2")))
    if world == 4:
        # Saved by 2 ranks, loaded by 4: resharding.
        timed("hs_load_from_2", lambda: hsd.load(hs.Store(root / "hs-2"), "ck-2", state()))
        timed("dcp_load_from_2", lambda: dcp.load(state(), checkpoint_id=str(root / "dcp-2-2")))
    flag = torch.zeros(1)
    for _ in range(200):
        timed("agree", lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX))
    worst = [None] * world
    dist.all_gather_object(worst, {k: max(v) if k != "agree" else statistics.median(v) for k, v in res.items()})
    if rank == 0:
        agg = {k: max(w[k] for w in worst) for k in worst[0]}
        agg["hs_bytes_per_rank"] = written
        agg["state_bytes"] = sum(t.numel() * t.element_size() for t in m.parameters()) * 3
        (out / f"dist-{world}.json").write_text(json.dumps(agg))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64, help="model parameters in MiB (AdamW state doubles it)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--root")
    a = ap.parse_args()
    if a.worker:
        worker(a.mib, Path(a.root), Path(a.root))
        return
    root = Path(tempfile.mkdtemp(prefix="hs-bench-dist-"))
    try:
        for n in (2, 4):
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc_per_node={n}",
                    __file__,
                    "--worker",
                    "--mib",
                    str(a.mib),
                    "--root",
                    str(root),
                ],
                env={**os.environ, "OMP_NUM_THREADS": "1"},
                check=True,
            )
        rows = []
        for n in (2, 4):
            r = json.loads((root / f"dist-{n}.json").read_text())
            rows += [
                (
                    f"{n} ranks: save blocked (slowest rank, worst of 3) vs DCP async_save",
                    r["hs_blocked"],
                    r["dcp_async_blocked"],
                ),
                (
                    f"{n} ranks: save to durable+committed vs DCP async_save result()",
                    r["hs_blocked"] + r["hs_durable"],
                    r["dcp_async_blocked"] + r["dcp_async_durable"],
                ),
                (f"{n} ranks: save to durable+committed vs DCP save", r["hs_blocked"] + r["hs_durable"], r["dcp_save"]),
                (f"{n} ranks: load, same layout vs DCP load", r["hs_load"], r["dcp_load"]),
            ]
            if n == 4:
                rows.append(("2 -> 4 ranks: resharding load vs DCP load", r["hs_load_from_2"], r["dcp_load_from_2"]))
            print(
                f"{n} ranks: one-flag all_reduce per step (median, what agreeing on a stop step costs): {r['agree'] * 1e6:.0f} us"
            )
            print(
                f"{n} ranks: state {fmt_b(r['state_bytes'])}, hindsight bytes written by rank 0: {fmt_b(r['hs_bytes_per_rank'])}"
            )
        print(f"{'metric':70} | {'hindsight':>9} | {'DCP':>9} | ratio")
        for name, h, d in rows:
            ratio = f"{h / d:.3f}" if d else "-"
            print(f"{name:70} | {fmt_s(h):>9} | {fmt_s(d):>9} | {ratio}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

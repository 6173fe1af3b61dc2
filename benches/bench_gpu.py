"""hindsight's GPU checkpoint path against torch.save, DCP async_save and torch.load, in one run.

    make bench-gpu                  # on a machine with an NVIDIA GPU
    python benches/bench_gpu.py [--sizes 2,8] [--epochs 8] [--json results.json] [--keep]
    python benches/bench_gpu.py --smoke     # tiny sizes on the CPU: checks the script, measures nothing

Part 1, for each size (GiB of CUDA state: fp32 parameters plus AdamW's two
moments after one step, in 64 MiB tensors), one store per side on the same
disk, every tensor changed before every save:

- training-thread blocked time per save, the first and the steady state:
  hindsight (first save cold, and first save after ``Store.prepare``, which
  ``hs.checkpointing`` calls after the first step), ``torch.save`` and
  ``torch.distributed.checkpoint.async_save``;
- the device-to-host floor: one copy of every tensor into pinned memory
  allocated beforehand;
- time to durable against a disk write + fsync of the same bytes;
- load onto the GPU against ``torch.load(map_location="cuda", weights_only=True)``;
- the on-device fingerprint that proves a tensor unchanged, per GiB.

Part 2, a GPU training script (an MLP, 8 epochs of ~1 s or more) recorded
with adaptive checkpoints, against the same script with hindsight replaced
by no-op stand-ins that parse the same arguments: record overhead, the
number of checkpoints taken, and the replay of a new epoch-level probe
against the recording (whole commands, start-up included).

Targets (issue 8): blocked <= 10 ms for 8 GiB, first save included;
durable within 1.2x of the disk floor; load <= 0.5x torch.load; record
overhead <= 1%; a checkpoint every epoch once epochs take >= 1 s; the
probe replays >= 5x faster than the recording.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

import benchutil
from benchutil import REPO, GiB, MiB, Table, dir_bytes, last_json, machine_info, now, run

OUT = REPO / "bench-out" / "gpu"
PKG = OUT / "pkg"
PY = sys.executable
TENSOR_BYTES = 64 * MiB
STEADY_SAVES = 3
# --quick: one save per baseline (torch.save, DCP async's first and one
# steady) and one no-op run, for a short GPU lease; the same metrics.
BASELINE_SAVES = {"torch": 2, "dcp": 1 + STEADY_SAVES, "plain": 2}
# --profile PATH: the last steady save runs under cProfile and CUDA sync
# debugging, the report appended to PATH (its blocked time then includes it).
PROFILE: Path | None = None


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def adamw_state(nbytes: int, device: str) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """Parameters and AdamW after one step: ``nbytes`` of state in all (3 x the parameters)."""
    per = TENSOR_BYTES // 4
    n_params = max(1, nbytes // 3 // 4)
    sizes = [per] * (n_params // per) + ([n_params % per] if n_params % per else [])
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, device=device, generator=gen)) for n in sizes]
    opt = torch.optim.AdamW(params, lr=1e-4)
    step(params, opt)
    return params, opt


def step(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> None:
    """Change every tensor of the state, as a training step does."""
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt.step()


def state_of(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": {f"p{i}": p for i, p in enumerate(params)}, "optim": opt.state_dict()}


def state_bytes(state: Any) -> int:
    from hindsight._state import tensor_bytes

    return tensor_bytes(state)


def disk_floor(nbytes: int, path: Path) -> float:
    """Seconds to write ``nbytes`` (64 MiB writes of one buffer already in memory) and fsync."""
    buf = os.urandom(TENSOR_BYTES)
    os.sync()
    t0 = now()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, memoryview(buf)[: min(left, len(buf))])
        os.fsync(fd)
    finally:
        os.close(fd)
    took = now() - t0
    path.unlink()
    return took


def d2h_floor(state: dict[str, Any], device: str) -> float | None:
    """Best of 2: one copy of every CUDA tensor into pinned memory allocated beforehand."""
    if not device.startswith("cuda"):
        return None
    tensors = [t for t in _tensors(state) if t.is_cuda]
    pinned = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, pin_memory=True) for t in tensors]
    best = float("inf")
    for _ in range(2):
        sync(device)
        t0 = now()
        for t, p in zip(tensors, pinned, strict=True):
            p.copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
        sync(device)
        best = min(best, now() - t0)
    del pinned
    return best


def _tensors(tree: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return out


def fingerprint_per_gib(state: dict[str, Any], device: str) -> tuple[float, float]:
    """Seconds per GiB of the proof that a tensor is unchanged: on the device
    (at a save, for a tensor whose version counter says unchanged) and on the
    host (a writer thread, from the copy of a changed tensor)."""
    from hindsight import _native
    from hindsight._staging import fingerprint

    tensors = [t for t in _tensors(state) if t.numel() > 0 and t.device.type == torch.device(device).type]
    total = sum(t.numel() * t.element_size() for t in tensors)
    fingerprint(tensors[0])  # uploads the multiplier table: once per process
    sync(device)
    t0 = now()
    for t in tensors:
        fingerprint(t)
    sync(device)
    on_device = (now() - t0) / (total / GiB)
    host = tensors[0].detach().cpu().reshape(-1).view(torch.uint8).numpy()
    t0 = now()
    _native.device_fingerprint_of(host)
    return on_device, (now() - t0) / (host.nbytes / GiB)


# --------------------------------------------------------------------------
# part 1: save, durable, load


def hindsight_saves(
    tab_rows: dict[str, Any], params: list[Any], opt: Any, device: str, root: Path, prepared: bool
) -> None:
    import hindsight as hs

    d = root / ("hs-prepared" if prepared else "hs-cold")
    store = hs.Store(d)
    if prepared:
        t0 = now()
        store.prepare(state_of(params, opt), wait=True)  # hs.checkpointing overlaps it with the first epoch
        tab_rows["prepare_s"] = now() - t0
    blocked, durable, setup = [], [], []
    for i in range(1 + (STEADY_SAVES if prepared else 0)):
        step(params, opt)
        sync(device)
        os.sync()
        state = state_of(params, opt)
        t0 = now()
        if PROFILE is not None and prepared and i == STEADY_SAVES:
            h = profiled_save(store, f"s{i}", state, PROFILE)  # the last steady save: where its time goes
        else:
            h = store.save(f"s{i}", state)
        blocked.append(now() - t0)
        setup.append(store.last_setup_seconds)
        h.wait()
        durable.append(now() - t0)
        del state
    tab_rows["blocked"] = blocked
    tab_rows["durable"] = durable
    tab_rows["setup"] = setup
    # Load onto the device (warm page cache, as for torch.load below).
    sync(device)
    t0 = now()
    got = store.load(f"s{len(blocked) - 1}", map_location=device)
    sync(device)
    tab_rows["load"] = now() - t0
    del got
    store.close()


def profiled_save(store: Any, name: str, state: Any, path: Path) -> Any:
    """``store.save`` under cProfile with torch's CUDA sync debugging on:
    each host-device synchronization the save makes is written with its
    stack, then the functions that held the thread (appended to ``path``).
    The blocked time it reports includes the profiler's overhead."""
    import cProfile
    import io
    import pstats
    import traceback
    import warnings

    syncs: list[str] = []

    def note(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        syncs.append(f"{message}\n{''.join(traceback.format_stack(limit=12)[:-1])}")

    prof = cProfile.Profile()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        debug = torch.cuda.is_available()  # --smoke on a CPU: the profile alone
        if debug:
            torch.cuda.set_sync_debug_mode("warn")
        t0 = now()
        try:
            h = prof.runcall(store.save, name, state)
        finally:
            if debug:
                torch.cuda.set_sync_debug_mode("default")
        took = now() - t0
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    with path.open("a") as f:
        f.write(f"== steady save {name}: {took * 1000:.1f} ms under the profiler, {len(syncs)} synchronizations\n")
        for s in syncs[:20]:
            f.write(s + "\n")
        f.write(out.getvalue())
    return h


def torch_saves(rows: dict[str, Any], params: list[Any], opt: Any, device: str, root: Path) -> None:
    path = root / "torch.pt"
    blocked = []
    for _ in range(BASELINE_SAVES["torch"]):
        step(params, opt)
        sync(device)
        os.sync()
        t0 = now()
        torch.save(state_of(params, opt), path)
        blocked.append(now() - t0)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        rows["durable"] = now() - t0
    rows["blocked"] = blocked
    sync(device)
    t0 = now()
    got = torch.load(path, map_location=device, weights_only=True)
    sync(device)
    rows["load"] = now() - t0
    del got
    path.unlink()


def dcp_saves(rows: dict[str, Any], params: list[Any], opt: Any, device: str, root: Path) -> None:
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
    except ImportError as e:
        rows["error"] = f"no torch.distributed.checkpoint: {e}"
        return
    if not dist.is_initialized():
        # One process, as for the other sides; DCP then takes the gloo group.
        dist.init_process_group("gloo", init_method=f"file://{OUT / 'pg'}", rank=0, world_size=1)
    blocked, durable = [], []
    for i in range(BASELINE_SAVES["dcp"]):
        step(params, opt)
        sync(device)
        os.sync()
        t0 = now()
        fut = dcp.async_save(state_of(params, opt), checkpoint_id=str(root / f"dcp-{i}"))
        blocked.append(now() - t0)
        fut.result()
        durable.append(now() - t0)
        shutil.rmtree(root / f"dcp-{i}", ignore_errors=True)
    rows["blocked"] = blocked
    rows["durable"] = durable


def part_save(tab: Table, raw: dict[str, Any], gib: float, device: str) -> None:
    nbytes = int(gib * GiB)
    root = OUT / f"save-{gib:g}"
    root.mkdir(parents=True)
    params, opt = adamw_state(nbytes, device)
    state = state_of(params, opt)
    total = state_bytes(state)
    floor_d2h = d2h_floor(state, device)
    fp, fp_host = fingerprint_per_gib(state, device)
    del state
    floor_disk = disk_floor(total, root / "floor.bin")
    cold: dict[str, Any] = {}
    hindsight_saves(cold, params, opt, device, root, prepared=False)
    shutil.rmtree(root / "hs-cold")
    hs_: dict[str, Any] = {}
    hindsight_saves(hs_, params, opt, device, root, prepared=True)
    ts: dict[str, Any] = {}
    torch_saves(ts, params, opt, device, root)
    dc: dict[str, Any] = {}
    dcp_saves(dc, params, opt, device, root)
    raw[f"{gib:g}GiB"] = {
        "state_bytes": total,
        "d2h_floor_s": floor_d2h,
        "disk_floor_s": floor_disk,
        "fingerprint_s_per_gib": fp,
        "fingerprint_host_s_per_gib": fp_host,
        "hindsight_cold": cold,
        "hindsight": hs_,
        "torch": ts,
        "dcp": dc,
    }
    steady = statistics.median(hs_["blocked"][1:]) if len(hs_["blocked"]) > 1 else None
    dcp_first = dc["blocked"][0] if dc.get("blocked") else None
    dcp_steady = statistics.median(dc["blocked"][1:]) if dc.get("blocked") else None
    tab.section(f"{gib:g} GiB of {device} state ({total / GiB:.2f} GiB: params + AdamW moments)")
    tab.add(
        "blocked: first save, cold (no prepare) vs torch.save",
        cold["blocked"][0],
        ts["blocked"][0],
        note=f"of which pinning {cold['setup'][0]:.2f} s",
    )
    tab.add(
        "blocked: first save after prepare vs DCP async first",
        hs_["blocked"][0],
        dcp_first,
        note=f"prepare ran {hs_['prepare_s']:.2f} s in the background",
    )
    tab.add("blocked: first save after prepare vs torch.save", hs_["blocked"][0], ts["blocked"][0])
    tab.add("blocked: steady (median) vs DCP async steady", steady, dcp_steady)
    tab.add("blocked: steady (median) vs torch.save", steady, statistics.median(ts["blocked"]))
    tab.add("blocked: first save after prepare vs 10 ms target", hs_["blocked"][0], 0.010, target=1.0)
    tab.add(
        "device-to-host floor (pinned, preallocated) vs hs steady durable",
        floor_d2h,
        statistics.median(hs_["durable"][1:]) if len(hs_["durable"]) > 1 else None,
    )
    tab.add(
        "durable: steady (median) vs disk write+fsync",
        statistics.median(hs_["durable"][1:] or hs_["durable"]),
        floor_disk,
        target=1.2,
    )
    if dc.get("durable"):
        tab.add("durable: DCP async (median) vs disk write+fsync", statistics.median(dc["durable"]), floor_disk)
    tab.add("durable: torch.save+fsync vs disk write+fsync", ts["durable"], floor_disk)
    tab.add(f"load to {device} vs torch.load(map_location, weights_only)", hs_["load"], ts["load"], target=0.5)
    tab.add("fingerprint on the device, per GiB (proves 'unchanged')", fp, None, note="per GiB of state")
    tab.add(
        "same fingerprint on the host, one writer thread, per GiB",
        fp_host,
        None,
        note="from the copy of a changed tensor",
    )
    del params, opt
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    shutil.rmtree(root)


# --------------------------------------------------------------------------
# part 2: record overhead, checkpoints taken, replay of an epoch-level probe

NOOP = '''\
"""No-op stand-ins for the hindsight calls of rec.py: same arguments, nothing recorded."""
import contextlib
import sys


def arg(name, default):
    flag = "--" + name
    if flag in sys.argv:
        v = sys.argv[sys.argv.index(flag) + 1]
        return type(default)(v) if default is not None else v
    return default


def loop(name, iterable):
    return iterable


def log(name, value):
    return value


@contextlib.contextmanager
def checkpointing(**objects):
    yield
'''


# --profile: the record is run once more with this as its sitecustomize. Each
# checkpoint's blocked time is split into its parts (capture, the store's
# save, arena waits, plain copies, device fingerprints), each host-device
# synchronization inside a save is counted by where it came from, and the
# saves' cProfile is appended to the profile.
SAVE_PROBE = """\
import atexit, cProfile, collections, io, os, pstats, time, traceback, warnings

import torch
from hindsight import _staging, _store
from hindsight._run import record

PATH = os.environ["HS_BENCH_PROFILE"]
prof = cProfile.Profile()
rows = []
parts = collections.Counter()
syncs = collections.Counter()
plain = [0, 0]
DEBUG = torch.cuda.is_available()  # --smoke on a CPU: the split alone


def timed(owner, name, key):
    orig = getattr(owner, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            parts[key] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


timed(record.RecordRun, "capture", "capture")
timed(_store.Store, "save", "store.save")
timed(_staging.DeviceCopies, "begin", "copies.begin")
timed(_staging.DeviceCopies, "end", "copies.end")
timed(_staging._Arena, "alloc", "arena.alloc")
timed(_staging, "device_fingerprints", "device_fingerprints")
copy = _staging.DeviceCopies.copy


def copy_counted(self, t):
    out = copy(self, t)
    if out[2] is None:
        plain[0] += 1
        plain[1] += t.numel() * t.element_size()
    return out


_staging.DeviceCopies.copy = copy_counted
save_now = record.RecordRun._save_now


def note(message, category, filename, lineno, file=None, line=None):
    frames = [f for f in traceback.extract_stack()[:-1] if "hindsight" in f.filename]
    where = f"{frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
    syncs[where] += 1


def probed(self, name, extra, wait):
    parts.clear()
    plain[:] = [0, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        if DEBUG:
            torch.cuda.set_sync_debug_mode("warn")
        t0 = time.perf_counter()
        prof.enable()
        try:
            return save_now(self, name, extra, wait)
        finally:
            prof.disable()
            took = time.perf_counter() - t0
            if DEBUG:
                torch.cuda.set_sync_debug_mode("default")
            arena = self.store._copies._arena
            rows.append((name, took, self.store.last_setup_seconds, dict(parts), tuple(plain),
                         arena.cap if arena is not None else None))


record.RecordRun._save_now = probed


@atexit.register
def report():
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
    with open(PATH, "a") as f:
        f.write("== record: each checkpoint's blocked time by part (ms)\\n")
        for name, took, setup, p, (n_plain, b_plain), cap in rows:
            split = ", ".join(f"{k} {v * 1000:.1f}" for k, v in sorted(p.items()))
            f.write(f"{name}: {took * 1000:.1f} (set-up {setup * 1000:.1f}; {split}; "
                    f"{n_plain} plain copies, {b_plain / 2**20:.1f} MiB; arena {cap})\\n")
        f.write(f"host-device synchronizations inside saves, by caller: {dict(syncs)}\\n")
        f.write(out.getvalue())
"""


def gpu_script(epochs: int, steps: int, width: int, device: str, probe: bool) -> str:
    lines = [
        '"""Generated by benches/bench_gpu.py: an MLP trained on synthetic data on the GPU."""',
        "import json",
        "import time",
        "",
        "import torch",
        "import hindsight as hs",
        "",
        f'epochs = hs.arg("epochs", {epochs})',
        f'steps = hs.arg("steps", {steps})',
        f'width = hs.arg("width", {width})',
        'lr = hs.arg("lr", 1e-3)',
        f'device = "{device}"',
        "torch.manual_seed(0)",
        "layers = []",
        "for _ in range(6):",
        "    layers += [torch.nn.Linear(width, width), torch.nn.GELU()]",
        "net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).to(device)",
        "opt = torch.optim.AdamW(net.parameters(), lr=lr)",
        "g = torch.Generator(device=device)",
        "t0 = time.perf_counter()",
        "with hs.checkpointing(model=net, optimizer=opt):",
        '    for epoch in hs.loop("epoch", range(epochs)):',
        "        g.manual_seed(epoch)",
        '        for s in hs.loop("step", range(steps)):',
        "            x = torch.randn(1024, width, device=device, generator=g)",
        "            loss = (net(x) - x[:, :1]).square().mean()",
        "            opt.zero_grad(set_to_none=True)",
        "            loss.backward()",
        "            opt.step()",
        '        hs.log("loss", loss.item())',
    ]
    if probe:
        lines.append(
            '        hs.log("weight_norm", torch.sqrt(sum((p.detach() ** 2).sum() for p in net.parameters())).item())'
        )
    lines += [
        "loop_s = time.perf_counter() - t0",
        'print(json.dumps({"loop_s": loop_s}))',
    ]
    return "\n".join(lines) + "\n"


def part_record(tab: Table, raw: dict[str, Any], epochs: int, steps: int, width: int, device: str) -> None:
    d = OUT / "record"
    d.mkdir(parents=True)
    (d / "rec.py").write_text(gpu_script(epochs, steps, width, device, probe=False))
    plain = d / "plain"
    plain.mkdir()
    (plain / "hindsight.py").write_text(NOOP)
    (plain / "rec.py").write_text(gpu_script(epochs, steps, width, device, probe=False))
    home = d / ".hindsight"
    env = benchutil.child_env(PKG, HINDSIGHT_HOME=str(home))
    plain_env = benchutil.child_env(PKG)
    plain_env["PYTHONPATH"] = str(plain) + os.pathsep + plain_env["PYTHONPATH"]  # the stand-ins win
    run([PY, "-c", "import torch, hindsight"], d, env, "warm-up")
    # What any process of the script pays before its first step: the floor
    # under a replay's whole command.
    floor = run([PY, "-c", f"import torch, hindsight; torch.zeros(1, device='{device}')"], d, env, "start-up floor")
    p1 = run([PY, "rec.py"], plain, plain_env, "plain (no-op stand-ins) #1")
    rec = run([PY, "rec.py"], d, env, "record")
    plains = [p1]
    if BASELINE_SAVES["plain"] > 1:
        plains.append(run([PY, "rec.py"], plain, plain_env, "plain (no-op stand-ins) #2"))
    plain_loop = statistics.mean(last_json(p["stdout"])["loop_s"] for p in plains)
    rec_loop = last_json(rec["stdout"])["loop_s"]
    from hindsight import _native

    db = _native.LogDb(str(home / "logs.db"))
    run_id = db.latest_run().id  # the project holds one script
    iters = db.iterations(run_id, "epoch")
    ckpts = [it for it in iters if it.checkpoint is not None]
    blocked = [it.materialize_seconds for it in ckpts if it.materialize_seconds is not None]
    epoch_s = [it.seconds for it in iters]
    # The new epoch-level probe, replayed.
    (d / "rec.py").write_text(gpu_script(epochs, steps, width, device, probe=True))
    rep = run([PY, "-m", "hindsight", "replay", "rec.py", "-q"], d, env, "replay", ok=(0, 1, 3))
    values = [r for r in db.logs(run_id, ["weight_norm"]) if r.phase == "replay"]
    if PROFILE is not None:
        # Once more, split into parts: the profiled run's timings are not the table's.
        prof_dir = d / "profiled"
        (prof_dir / "probe").mkdir(parents=True)
        (prof_dir / "probe" / "sitecustomize.py").write_text(SAVE_PROBE)
        (prof_dir / "rec.py").write_text(gpu_script(epochs, steps, width, device, probe=False))
        penv = benchutil.child_env(
            PKG, HINDSIGHT_HOME=str(prof_dir / ".hindsight"), HINDSIGHT_VERBOSE="1", HS_BENCH_PROFILE=str(PROFILE)
        )
        penv["PYTHONPATH"] = str(prof_dir / "probe") + os.pathsep + penv["PYTHONPATH"]
        prof = run([PY, "rec.py"], prof_dir, penv, "record, profiled")
        with PROFILE.open("a") as f:
            f.write(f"== record, profiled: its stderr\n{prof['stderr'][-6000:]}\n")
            f.write(f"== the replay's stdout\n{rep['stdout'][-3000:]}\n")
    raw["record"] = {
        "plain_loop_s": [last_json(p["stdout"])["loop_s"] for p in plains],
        "rec_loop_s": rec_loop,
        "rec_wall_s": rec["wall_s"],
        "epoch_s": epoch_s,
        "checkpoints": len(ckpts),
        "blocked_s": blocked,
        "plain_wall_s": [p["wall_s"] for p in plains],
        "startup_floor_s": floor["wall_s"],
        "replay_wall_s": rep["wall_s"],
        "replay_rc": rep["rc"],
        "replay_stdout": rep["stdout"][-2000:],
        "replay_stderr": rep["stderr"][-2000:],
        "probe_values": len(values),
        "store_bytes": dir_bytes(home / "store") if (home / "store").exists() else None,
    }
    tab.section(
        f"GPU training script: {epochs} epochs x {steps} steps, width {width} "
        f"(epoch {statistics.median(epoch_s):.2f} s)"
    )
    tab.add(f"record overhead: loop vs no-op stand-ins (mean of {len(plains)})", rec_loop, plain_loop, target=1.01)
    tab.add(
        "checkpoints taken (adaptive) / epochs",
        None,
        None,
        ratio=len(ckpts) / max(1, len(iters)),
        target=1.0,
        higher_is_better=True,
        note=f"{len(ckpts)} of {len(iters)}; save blocked median "
        + (f"{statistics.median(blocked) * 1000:.1f} ms" if blocked else "-"),
    )
    tab.add(
        "epoch-level probe: replay vs recording (whole commands)",
        rep["wall_s"],
        rec["wall_s"],
        target=0.2,
        note=f"exit {rep['rc']}, {len(values)}/{epochs} values",
    )
    tab.add(
        "epoch-level probe: replay vs the plain script (whole commands)",
        rep["wall_s"],
        statistics.mean(p["wall_s"] for p in plains),
        note=f"start-up floor (import torch, hindsight; CUDA) {floor['wall_s']:.1f} s",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sizes",
        default="2,8",
        help="GiB of CUDA state to save, comma-separated (default 2,8; '' for none: part 2 alone)",
    )
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300, help="steps per epoch of the training script (1.2 s on an H100)")
    ap.add_argument("--width", type=int, default=2048, help="width of the training script's MLP")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the script only")
    ap.add_argument("--quick", action="store_true", help="one save per baseline and one no-op run (short leases)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--no-record", action="store_true", help="part 1 only (saves and loads), not the training script")
    ap.add_argument("--profile", metavar="PATH", help="profile the last steady save of each size into PATH")
    ap.add_argument("--keep", action="store_true", help="leave bench-out/gpu/ in place")
    args = ap.parse_args()
    if args.profile:
        global PROFILE
        PROFILE = Path(args.profile)
    if args.quick:
        BASELINE_SAVES.update(torch=1, dcp=2, plain=1)
    if args.smoke:
        device, sizes, steps, width, epochs = "cpu", [0.02], 10, 64, 3
    else:
        if not torch.cuda.is_available():
            print(
                "bench_gpu: no CUDA device visible to torch (use --smoke to check the script on a CPU)", file=sys.stderr
            )
            return 2
        device, sizes = "cuda", [float(s) for s in args.sizes.split(",") if s]
        steps, width, epochs = args.steps, args.width, args.epochs
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    raw: dict[str, Any] = {"machine": machine_info(OUT), "package": benchutil.snapshot_package(PKG)}
    if device == "cuda":
        raw["gpu"] = torch.cuda.get_device_name()
    tab = Table()
    try:
        for gib in sizes:
            part_save(tab, raw, gib, device)
        if not args.no_record:
            part_record(tab, raw, epochs, steps, width, device)
    finally:
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        print(f"\nmachine: {json.dumps(raw['machine'])}\ndevice: {raw.get('gpu', device)}")
        print(tab.render())
        if args.json:
            Path(args.json).write_text(json.dumps(raw, indent=1, default=str))
        if not args.keep:
            shutil.rmtree(OUT, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

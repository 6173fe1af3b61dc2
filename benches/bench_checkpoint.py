"""hindsight vs torch.save / torch.load, measured in one run on one disk.

    make bench                      # builds the release extension first
    python benches/bench_checkpoint.py [--json results.json] [--keep] [--only AB]

Everything is written under ``bench-out/checkpoint/`` in the repository root
(git-ignored) and removed at the end (``bench-out/`` too, if nothing else is in
it: other benchmarks use their own directories beside this one). Cases:

A  ~1 GiB float32 state dict, every tensor changed before every save:
   time the caller is blocked in save, time until durable, full / partial load.
B  fine-tuning: ~1 GiB, 90% of the bytes frozen, 10% changed before each of
   10 saves: bytes written and blocked time.
C  compression: 128 MiB float32 (random normal) and bfloat16 weights,
   zstd vs the raw default: bytes stored and time until durable.
D  proving a tensor unchanged: saves of a 1 GiB state that did not change
   (every byte is fingerprinted before a tensor may be skipped), per GiB,
   against the copy a skip avoids and against torch.save.
E  a save while gc runs: a store of E_CHECKPOINTS small checkpoints, gc in a
   loop on another thread, the durable time of saves made meanwhile against
   the same saves with no gc (a save waits for gc only while it deletes).

Page caches cannot be dropped reliably here, so loads read warm files (for
both sides) and, before every timed save, ``os.sync()`` (untimed) flushes
earlier dirty data so no measurement pays for another one's writeback.
hindsight and torch runs are interleaved and each side keeps one checkpoint
on disk in case A, so both see the same memory and page-cache conditions:
on VMs that hand freed memory back to the host (reported in the header),
touching new memory is several times slower than reusing mapped memory, and
single timings swing widely; the raw repetitions are printed after the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

import hindsight

from benchutil import REPO, GiB, MiB, Table, cpu_snapshot, fmt_b, fmt_s, machine_info, now

OUT = REPO / "bench-out" / "checkpoint"

# Case sizes.
A_TENSORS = 16
A_NUMEL = 16 * MiB  # float32 elements per tensor: 64 MiB each, 1 GiB total
A_SAVES = 7  # save #1 (cold staging) and steady state over saves 2..7
MEMCPY_REPS = 5
LOAD_REPS = 3
B_FROZEN = 18  # tensors of B_NUMEL: 90% of the bytes
B_TRAINABLE = 8  # tensors of B_NUMEL // 4: 10% of the bytes
B_NUMEL = GiB // 4 // (B_FROZEN + B_TRAINABLE // 4)
B_SAVES = 10
C_BYTES = 128 * MiB
C_REPS = 4  # the first save of a fresh store pays for fresh staging memory; report 2..4


# --------------------------------------------------------------------------
# helpers


def quiesce() -> None:
    """Untimed: collect garbage and push earlier dirty pages to disk."""
    gc.collect()
    os.sync()


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def touch(state: dict[str, torch.Tensor], keys: list[str] | None = None) -> None:
    """An optimizer step: change every element in place (bumps version counters)."""
    with torch.no_grad():
        for k in keys if keys is not None else list(state):
            state[k].add_(1e-3)


def random_state(count: int, numel: int, prefix: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {f"{prefix}{i}.weight": torch.empty(numel).normal_(generator=gen) for i in range(count)}


def torch_save_timed(state: Any, path: Path, fsync: bool) -> float:
    """Seconds for torch.save(state, path) [+ fsync of the file]."""
    if path.exists():
        path.unlink()
    quiesce()
    t0 = now()
    torch.save(state, path)
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return now() - t0


def balloon_reporting() -> bool | None:
    """Whether a virtio balloon returns freed guest memory to the host (free
    page reporting): then memory touched for the first time since it was
    freed is slow to fault in, and timings depend on allocation history."""
    found = None
    for dev in Path("/sys/bus/virtio/devices").glob("*"):
        try:
            if (dev / "device").read_text().strip() == "0x0005":
                found = (dev / "features").read_text().strip()[5:6] == "1"
        except OSError:
            continue
    return found


def memory_probe() -> tuple[float, float]:
    """Seconds per GiB to fill newly allocated memory, and to fill it again."""
    a = torch.empty(GiB // 4)
    t0 = now()
    a.fill_(1.0)
    t1 = now()
    a.fill_(2.0)
    t2 = now()
    del a
    gc.collect()
    return t1 - t0, t2 - t1


# --------------------------------------------------------------------------
# case A: 1 GiB, everything changes


def case_a(tab: Table, raw: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(1)
    state = random_state(A_TENSORS, A_NUMEL, "layer", gen)
    size = nbytes(state)
    raw["a_bytes"] = size
    tab.section(f"A: {fmt_b(size)} float32, {A_TENSORS} tensors, all changed before each save")

    # Physical floor: copy the same bytes into preallocated (already touched) memory.
    dst = {k: torch.zeros_like(t) for k, t in state.items()}
    memcpy = []
    for _ in range(MEMCPY_REPS):
        gc.collect()
        t0 = now()
        for k, t in state.items():
            dst[k].copy_(t)
        memcpy.append(now() - t0)
    del dst
    gc.collect()
    raw["a_memcpy_s"] = memcpy

    # Interleaved, so both sides see the same machine state: each round saves
    # with hindsight (save #1 has fresh staging memory, later saves reuse it),
    # then with torch.save, then with torch.save + fsync. Each side keeps one
    # checkpoint on disk: torch overwrites its file, hindsight removes the
    # previous checkpoint and collects its chunks (untimed) before saving.
    store = hindsight.Store(OUT / "hs-a")
    tpath = OUT / "torch-a.pt"
    key = next(iter(state))
    blocked, durable, engine_durable, stats = [], [], [], []
    t_plain, t_fsync = [], []
    prev = None
    for i in range(1, A_SAVES + 1):
        touch(state)
        if prev is not None:
            store.remove(prev)
            store.gc()
        quiesce()
        t0 = now()
        h = store.save(f"a{i}", state)
        t1 = now()
        st = h.wait()
        t2 = now()
        blocked.append(t1 - t0)
        durable.append(t2 - t0)
        engine_durable.append(st["seconds_to_durable"])
        stats.append(st)
        prev = f"a{i}"
        hs_key = state[key].clone()  # what the latest hindsight checkpoint holds
        touch(state)
        t_plain.append(torch_save_timed(state, tpath, fsync=False))
        touch(state)
        t_fsync.append(torch_save_timed(state, tpath, fsync=True))
    th_key = state[key].clone()  # what the torch file holds
    raw.update(
        a_hs_blocked_s=blocked,
        a_hs_durable_s=durable,
        a_hs_engine_durable_s=engine_durable,
        a_hs_stats=stats,
        a_torch_save_s=t_plain,
        a_torch_save_fsync_s=t_fsync,
        a_torch_file_bytes=tpath.stat().st_size,
    )
    del state
    quiesce()

    # Loads, warm cache for both (just written); check what was read back.
    hs_load, th_load, hs_part, th_mmap = [], [], [], []
    for _ in range(LOAD_REPS):
        gc.collect()
        t0 = now()
        got = store.load(prev)
        hs_load.append(now() - t0)
        assert len(got) == A_TENSORS and torch.equal(got[key], hs_key), "hindsight load mismatch"
        del got
        gc.collect()
        t0 = now()
        got = torch.load(tpath, weights_only=True)
        th_load.append(now() - t0)
        assert len(got) == A_TENSORS and torch.equal(got[key], th_key), "torch load mismatch"
        del got
        gc.collect()
        t0 = now()
        one = store.load(prev, path=key)
        hs_part.append(now() - t0)
        assert torch.equal(one, hs_key)
        del one
        gc.collect()
        t0 = now()
        one = torch.load(tpath, weights_only=True, mmap=True)[key].clone()
        th_mmap.append(now() - t0)
        del one
    raw.update(a_hs_load_s=hs_load, a_torch_load_s=th_load, a_hs_load_key_s=hs_part, a_torch_mmap_key_s=th_mmap)
    store.close()
    del store, hs_key, th_key
    gc.collect()

    steady_b = statistics.median(blocked[1:])
    steady_d = statistics.median(durable[1:])
    t_save = statistics.median(t_plain)
    t_save_fs = statistics.median(t_fsync)
    floor = min(memcpy)
    tab.add("blocked: save #1 (fresh staging) vs torch.save", blocked[0], t_save, target=0.10)
    tab.add(f"blocked: steady, median saves 2-{A_SAVES} vs torch.save", steady_b, t_save, target=0.10)
    tab.add(f"  same, vs torch.save best of {A_SAVES} (conservative)", steady_b, min(t_plain), target=0.10)
    tab.add(
        f"  floor: memcpy into preallocated, best of {MEMCPY_REPS}", floor, t_save, note="= best possible ratio here"
    )
    tab.add("  steady blocked / memcpy floor", None, None, ratio=steady_b / floor, unit="x")
    tab.add("durable: save -> wait(), save #1 vs torch.save+fsync", durable[0], t_save_fs)
    tab.add(f"durable: save -> wait(), median 2-{A_SAVES} vs torch.save+fsync", steady_d, t_save_fs)
    tab.add(f"  same, vs torch.save+fsync best of {A_SAVES}", steady_d, min(t_fsync))
    tab.add("  same, vs torch.save without fsync", steady_d, t_save)
    tab.add(f"  engine stat seconds_to_durable, median 2-{A_SAVES}", statistics.median(engine_durable[1:]), None)
    tab.add(f"load all, best of {LOAD_REPS} vs torch.load(weights_only)", min(hs_load), min(th_load))
    tab.add("load one key (64 MiB) vs torch.load of everything", min(hs_part), min(th_load))
    tab.add("  same, vs torch.load(mmap=True)[key].clone()", min(hs_part), min(th_mmap))
    tab.add("bytes written per save vs torch file", stats[-1]["bytes_written"], raw["a_torch_file_bytes"], unit="B")
    spread = raw.setdefault("spread", [])
    spread.append(("A hindsight blocked", blocked))
    spread.append(("A hindsight durable", durable))
    spread.append(("A torch.save", t_plain))
    spread.append(("A torch.save+fsync", t_fsync))
    spread.append(("A memcpy", memcpy))
    spread.append(("A hindsight load", hs_load))
    spread.append(("A torch.load", th_load))


# --------------------------------------------------------------------------
# case B: fine-tuning, 90% frozen


def case_b(tab: Table, raw: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(2)
    state = random_state(B_FROZEN, B_NUMEL, "frozen", gen)
    trainable = random_state(B_TRAINABLE, B_NUMEL // 4, "adapter", gen)
    state.update(trainable)
    tkeys = list(trainable)
    del trainable
    size = nbytes(state)
    tsize = sum(state[k].numel() * 4 for k in tkeys)
    raw.update(b_bytes=size, b_trainable_bytes=tsize)
    tab.section(f"B: fine-tuning, {fmt_b(size)}, {100 * tsize / size:.0f}% changed before each of {B_SAVES} saves")

    # Interleaved: one hindsight save, then one torch.save, per step.
    store = hindsight.Store(OUT / "hs-b")
    tpath = OUT / "torch-b.pt"
    blocked, stats, t_blocked, t_sizes = [], [], [], []
    for i in range(B_SAVES):
        touch(state, tkeys)
        quiesce()
        t0 = now()
        h = store.save(f"b{i}", state)
        blocked.append(now() - t0)
        stats.append(h.wait())
        touch(state, tkeys)
        t_blocked.append(torch_save_timed(state, tpath, fsync=False))
        t_sizes.append(tpath.stat().st_size)
        tpath.unlink()  # only its size matters
    store.flush()
    usage = store.usage()
    store.close()
    del store, state
    gc.collect()
    raw.update(
        b_hs_blocked_s=blocked, b_hs_stats=stats, b_hs_usage=usage, b_torch_blocked_s=t_blocked, b_torch_sizes=t_sizes
    )

    hs_written = sum(s["bytes_written"] for s in stats)
    hs_inc = sum(s["bytes_written"] for s in stats[1:])
    floor = (size + (B_SAVES - 1) * tsize) / (B_SAVES * size)
    raw["b_floor_ratio"] = floor
    tab.add(
        f"bytes written, {B_SAVES} saves (sum of stats) vs file sizes", hs_written, sum(t_sizes), unit="B", target=0.15
    )
    tab.add(
        f"  floor for this case: 1 full + {B_SAVES - 1} x {100 * tsize / size:.0f}%",
        None,
        None,
        ratio=floor,
        unit="x",
        note="the 0.15 target is below it",
    )
    tab.add(f"bytes written, saves 2-{B_SAVES} (incremental)", hs_inc, sum(t_sizes[1:]), unit="B", target=0.15)
    tab.add(
        "  cross-check: store.usage() stored_bytes",
        usage["stored_bytes"],
        sum(t_sizes),
        unit="B",
        note=f"logical {fmt_b(usage['logical_bytes'])}, unique {fmt_b(usage['unique_bytes'])}",
    )
    tab.add(f"blocked: mean of {B_SAVES} saves vs torch.save", statistics.mean(blocked), statistics.mean(t_blocked))
    tab.add(f"blocked: mean saves 2-{B_SAVES}", statistics.mean(blocked[1:]), statistics.mean(t_blocked[1:]))
    raw.setdefault("spread", []).extend([("B hindsight blocked", blocked), ("B torch.save", t_blocked)])


# --------------------------------------------------------------------------
# case C: compression


def case_c(tab: Table, raw: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(3)
    n32 = C_BYTES // 4 // 8
    f32 = {f"w{i}": torch.empty(n32).normal_(std=0.02, generator=gen) for i in range(8)}
    bf16 = {f"w{i}": torch.empty(2 * n32).normal_(std=0.02, generator=gen).to(torch.bfloat16) for i in range(8)}
    tab.section(f"C: compression, {fmt_b(C_BYTES)} of weights; columns: hindsight = zstd, torch = raw default")
    for label, state in (("float32 normal", f32), ("bfloat16 normal", bf16)):
        res: dict[str, dict[str, Any]] = {}
        for codec in ("zstd", None):
            name = codec or "raw"
            store = hindsight.Store(OUT / f"hs-c-{label.split()[0]}-{name}", compression=codec)
            blocked, durable = [], []
            for i in range(C_REPS):
                touch(state)
                quiesce()
                t0 = now()
                h = store.save(f"c{i}", state)
                t1 = now()
                h.wait()
                durable.append(now() - t0)
                blocked.append(t1 - t0)
            usage = store.usage()
            store.close()
            del store
            res[name] = {
                "blocked_s": blocked,
                "durable_s": durable,
                "stored_bytes": usage["stored_bytes"],
                "logical_bytes": usage["logical_bytes"],
            }
        raw[f"c_{label.split()[0]}"] = res
        z, r = res["zstd"], res["raw"]
        tab.add(f"{label}: bytes stored ({C_REPS} saves)", z["stored_bytes"], r["stored_bytes"], unit="B")
        tab.add(
            f"{label}: save -> durable, median 2-{C_REPS}",
            statistics.median(z["durable_s"][1:]),
            statistics.median(r["durable_s"][1:]),
        )
        tab.add(
            f"{label}: blocked in save, median 2-{C_REPS}",
            statistics.median(z["blocked_s"][1:]),
            statistics.median(r["blocked_s"][1:]),
        )
    del f32, bf16
    gc.collect()


# --------------------------------------------------------------------------


# --------------------------------------------------------------------------
# case D: the cost of proving a tensor unchanged


D_REPS = 5


def case_d(tab: Table, raw: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(4)
    state = random_state(A_TENSORS, A_NUMEL, "w", gen)
    size = nbytes(state)
    tab.section(f"D: proof that {fmt_b(size)} is unchanged (full-content fingerprint), per GiB")
    store = hindsight.Store(OUT / "hs-d")
    store.save("d0", state).wait()
    blocked = []
    for i in range(D_REPS):
        quiesce()
        t0 = now()
        h = store.save(f"d{i + 1}", state)
        blocked.append(now() - t0)
        st = h.wait()
        assert st["bytes_reused"] == size, st  # proven, not copied
    store.close()
    copies = {k: torch.empty_like(v) for k, v in state.items()}
    memcpy = []
    for _ in range(MEMCPY_REPS):
        t0 = now()
        for k, v in state.items():
            copies[k].copy_(v)
        memcpy.append(now() - t0)
    t_save = torch_save_timed(state, OUT / "torch-d.pt", fsync=False)
    (OUT / "torch-d.pt").unlink()
    per_gib = GiB / size
    proof = statistics.median(blocked) * per_gib
    raw.update(d_blocked_s=blocked, d_memcpy_s=memcpy, d_torch_save_s=t_save)
    tab.add(
        "blocked per GiB, unchanged state vs the copy it avoids",
        proof,
        min(memcpy) * per_gib,
        note="fingerprint (xxh3, all cores) instead of memcpy",
    )
    tab.add("  same, vs torch.save of the state", proof, t_save * per_gib)
    raw.setdefault("spread", []).append(("D hindsight unchanged blocked", blocked))
    del state, copies
    gc.collect()


E_CHECKPOINTS = 3000
E_SAVES = 40


def case_e(tab: Table, raw: dict[str, Any]) -> None:
    import threading

    tab.section(f"E: a save while gc runs over {E_CHECKPOINTS} checkpoints (no torch equivalent: vs no gc)")
    store = hindsight.Store(OUT / "hs-e")
    gen = torch.Generator().manual_seed(5)
    for i in range(E_CHECKPOINTS):
        store.save(f"e{i:05d}", {"w": torch.randn(64, generator=gen), "step": i})
    store.flush()
    t0 = now()
    store.gc()
    gc_pass = now() - t0

    def saves(tag: str) -> list[float]:
        out = []
        for i in range(E_SAVES):
            t = now()
            store.save(f"{tag}{i:03d}", {"w": torch.randn(64, generator=gen)}).wait()
            out.append(now() - t)
        return out

    alone = saves("alone")
    stop = threading.Event()
    passes = [0]

    def gc_loop() -> None:
        while not stop.is_set():
            store.gc()
            passes[0] += 1

    th = threading.Thread(target=gc_loop)
    th.start()
    during = saves("during")
    stop.set()
    th.join()
    store.close()
    raw.update(e_gc_pass_s=gc_pass, e_alone_s=alone, e_during_s=during, e_gc_passes=passes[0])
    tab.add("one gc pass", gc_pass, None, note=f"{E_CHECKPOINTS} manifests")
    tab.add("save until durable, median: during gc vs alone", statistics.median(during), statistics.median(alone))
    tab.add("save until durable, worst: during gc vs alone", max(during), max(alone), note=f"{passes[0]} gc passes")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--keep", action="store_true", help="leave bench-out/checkpoint/ in place")
    ap.add_argument("--only", default="ABCDE", help="cases to run (default ABCDE)")
    args = ap.parse_args()

    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    started = now()
    cpu0 = cpu_snapshot()
    try:
        info = machine_info(OUT)
        ram = info["ram_bytes"]
        print("hindsight benchmark (one run, one disk; timings from time.perf_counter)")
        print(f"  cpu        {info['cpu']}, {info['cores']} cores (torch threads: {info['torch_threads']})")
        print(f"  ram        {fmt_b(ram) if ram else 'unknown'}")
        print(f"  torch      {info['torch']}, python {info['python']}, kernel {info['kernel']}")
        print(f"  filesystem {info['filesystem']}  [bench-out/checkpoint/]")
        print(f"  git        {info['git']}")
        fresh, mapped = memory_probe()
        info.update(fill_fresh_s_per_gib=fresh, fill_mapped_s_per_gib=mapped, balloon_reporting=balloon_reporting())
        print(f"  memory     filling 1 GiB: {fmt_s(fresh)} newly allocated, {fmt_s(mapped)} once mapped", end="")
        print("; VM returns freed memory to the host" if info["balloon_reporting"] else "")
        print(flush=True)

        tab = Table()
        raw: dict[str, Any] = {}
        cases = {"A": case_a, "B": case_b, "C": case_c, "D": case_d, "E": case_e}
        for c in args.only.upper():
            t0 = now()
            cases[c](tab, raw)
            raw[f"case_{c}_seconds"] = now() - t0
            print(f"  (case {c} took {now() - t0:.0f} s)", file=sys.stderr, flush=True)

        print(tab.render(("metric", "hindsight", "torch", "ratio", "target")))
        print()
        print("ratio = hindsight / torch (lower is better). blocked = time the calling thread spends")
        print("in the save call; durable = until the data is on disk (hindsight: h.wait()).")
        if raw.get("spread"):
            print()
            print("repeated measurements, in order (ms):")
        for label, xs in raw.get("spread", []):
            print(f"  {label:<22} " + " ".join(f"{x * 1000:6.0f}" for x in xs))
        busy, steal, own = (b - a for a, b in zip(cpu0, cpu_snapshot(), strict=True))
        wall = now() - started
        other = max(0.0, busy - own)
        cores = os.cpu_count() or 1
        raw["cpu"] = {"wall_s": wall, "machine_busy_s": busy, "own_s": own, "other_s": other, "steal_s": steal}
        print(
            f"CPU: this process {own:.0f} CPU-s; rest of the machine (other processes, kernel I/O "
            f"threads) {other:.0f} CPU-s = {100 * other / (wall * cores):.0f}% of {cores} cores; "
            f"hypervisor steal {steal:.0f} s"
        )
        if other > 0.10 * wall * cores or steal > 0.05 * wall * cores:
            print("WARNING: the machine was not idle during the run; timings are disturbed.")
        print(f"total run time {now() - started:.0f} s")
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": info, "rows": tab.rows, "raw": raw}, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(OUT, ignore_errors=True)
            try:
                OUT.parent.rmdir()  # bench-out/, if nothing else is in it
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

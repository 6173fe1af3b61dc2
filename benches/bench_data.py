"""The input service (``Loader``), measured in one run.

    make bench-data                 # builds the release extension, installs matplotlib
    python benches/bench_data.py [--examples 4096] [--rounds 3] [--splits 1000,10000,50000]

The dataset is ``benches/data_pipelines.py:augmented``, a CPU-bound
augmentation pipeline (about 1 ms of one core per example: a 3x96x96
image from a per-index generator, random crop to 80x80, flip, colour jitter,
rotation, blur, noise, normalization; random draws from the global
generators), batches of 64, every example carrying its index.

1. Throughput: ``hs.data.Loader(workers="local:2")`` against
   ``torch.utils.data.DataLoader(num_workers=2, shuffle=True,
   persistent_workers=True)`` on the same dataset and batch size, the
   consumer only iterating. One warm-up epoch each, then epochs alternated
   (hindsight, DataLoader, hindsight, ...) so both see the same drift of a
   shared machine; examples/s = examples / wall time of the measured epochs
   (each from ``iter()`` to the last batch, so the pipeline fill at the
   start of an epoch counts for both). The CPU each side spends (its worker
   processes, the trainer process) and an in-process split of one batch's
   worker work show where the time goes.
2. A worker killed: during an epoch of ``local:2``, SIGKILL one worker when
   40% of the batches have arrived. Every delivery is timestamped; detection
   + failover = the longest gap between deliveries after the kill minus the
   typical (median) gap, next to the client's own ``last_failover_seconds``.
   The epoch is audited for duplicated and missing examples and for the
   order (seed, epoch) fixes. Throughput over time (0.25 s bins) goes to
   ``bench-out/data_failover.png``, beside the epoch before it (no kill).
3. Journal replay: jobs of N one-example splits (``split_batches=1``,
   ``batch_size=1``, the ``tiny`` dataset) run once through a dispatcher
   started here with 2 remote-style workers; then starting a dispatcher on
   that journal (which replays it) is timed.
4. Worker checkpoints (the seed's stall-versus-recomputation trade-off): a
   sharded dataset whose shards cannot seek (``tests/data_synth.py:stream``:
   reaching record k reads the k before it) in two regimes: free reads of
   large (256 KiB) records, where a checkpoint of the records read ahead
   costs more than reading them again, and a costly read (2 ms) of small
   records, where it costs far less; ``local:1``, ``checkpoint_overhead`` 0 (never) against 0.05
   (the policy decides). Per case: an epoch without failures (the price of
   checkpointing), then an epoch with the worker killed mid-split; records
   read only to seek (scanning to an offset) and reader resumes from a
   worker checkpoint are counted from the dataset's open log.

Scratch files go under ``bench-out/data/`` (removed at the end); the plot
stays in ``bench-out/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import data_pipelines
from hindsight import _native
from hindsight.data import Loader
from hindsight.errors import StorageError

from benchutil import REPO, cpu_snapshot, machine_info, now

OUT = REPO / "bench-out"
SCRATCH = OUT / "data"
PLOT = OUT / "data_failover.png"

BATCH = 64
WORKERS = 2
SPLIT_BATCHES = 2
SEED = 0
KILL_AT = 0.40  # fraction of the epoch's batches delivered when a worker is killed
BIN_S = 0.25
THROUGHPUT_TARGET = 0.95  # hindsight / DataLoader examples/s
FAILOVER_TARGET_S = 1.0
JOURNAL_WINDOW = 512  # splits in flight while producing the journals (see part 3)
REPLAY_REPS = 5
BREAKDOWN_REPS = 10  # rounds of the per-batch CPU split (the least counts)


# --------------------------------------------------------------------------
# helpers


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Plain columns: the first ``left`` and the last one left-aligned, the rest right-aligned."""
    cells = [list(headers), *[list(r) for r in rows]]
    w = [max(len(c[i]) for c in cells) for i in range(len(headers))]
    last = len(headers) - 1

    def line(c: list[str]) -> str:
        return " | ".join(c[i].ljust(w[i]) if i < left or i == last else c[i].rjust(w[i]) for i in range(len(c)))

    return "\n".join([line(cells[0]), "-" * (sum(w) + 3 * last), *(line(c).rstrip() for c in cells[1:])])


def verdict(value: float, target: float, higher_is_better: bool) -> str:
    good = value >= target if higher_is_better else value <= target
    return f"{'>=' if higher_is_better else '<='} {target:g} {'ok' if good else 'MISS'}"


def proc_cpu(pid: int) -> float | None:
    """CPU-seconds (user + system, all threads) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children() -> list[int]:
    """This process's child processes (worker processes of both loaders)."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me:
            out.append(int(entry))
    return out


class CpuMeter:
    """CPU spent during a span: by this process, by the given child
    processes, and by everything else on the machine (other users)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.t0 = now()
        self.busy0, self.steal0, _ = cpu_snapshot()
        self.own0 = time.process_time()
        self.kids0 = {p: proc_cpu(p) for p in pids}

    def stop(self) -> dict[str, float]:
        wall = now() - self.t0
        busy, steal, _ = cpu_snapshot()
        own = time.process_time() - self.own0
        kids = 0.0
        for p, c0 in self.kids0.items():
            c1 = proc_cpu(p)
            if c0 is not None and c1 is not None:
                kids += c1 - c0
        machine = busy - self.busy0
        return {
            "wall": wall,
            "trainer": own,
            "workers": kids,
            "others": max(0.0, machine - own - kids),
            "steal": steal - self.steal0,
        }


def timed_epoch(batches: Iterator[dict[str, torch.Tensor]], pids: list[int]) -> dict[str, Any]:
    """Iterate an epoch doing nothing with the batches; delivery times and CPU."""
    meter = CpuMeter(pids)
    t0 = now()
    times, indices = [], []
    for b in batches:
        times.append(now() - t0)
        indices.append(b["index"])
    out: dict[str, Any] = meter.stop()
    out["t0"] = t0
    out["times"] = times
    out["examples"] = sum(int(i.numel()) for i in indices)
    out["indices"] = indices
    return out


def audit(indices: list[torch.Tensor], n: int) -> tuple[int, int]:
    """(duplicates, missing) among the delivered example indices of an epoch of ``n`` examples."""
    seen = [int(i) for t in indices for i in t]
    return len(seen) - len(set(seen)), len(set(range(n)) - set(seen))


def hs_loader(n: int) -> Loader:
    return Loader(
        data_pipelines.augmented,
        batch_size=BATCH,
        seed=SEED,
        workers=f"local:{WORKERS}",
        split_batches=SPLIT_BATCHES,
        dataset_args={"n": n},
    )


def hs_epoch(loader: Loader, epoch: int, during: Any = None) -> Iterator[dict[str, torch.Tensor]]:
    loader.set_epoch(epoch)
    for k, batch in enumerate(loader, 1):
        if during is not None:
            during(k)
        yield batch


# --------------------------------------------------------------------------
# part 1: throughput


def part_throughput(n: int, rounds: int, raw: dict[str, Any]) -> tuple[Loader, list[str]]:
    lines: list[str] = []
    # The DataLoader's workers are forked: start them before this process
    # has the hindsight client's threads.
    dl = torch.utils.data.DataLoader(
        data_pipelines.augmented(n), batch_size=BATCH, num_workers=WORKERS, shuffle=True, persistent_workers=True
    )
    torch.manual_seed(SEED)
    warm_dl = timed_epoch(iter(dl), [])
    dl_pids = children()
    loader = hs_loader(n)
    warm_hs = timed_epoch(hs_epoch(loader, 0), [])
    hs_pids = loader.worker_pids()
    dl_pids = [p for p in dl_pids if p not in hs_pids]
    raw["warmup_s"] = {"hindsight": warm_hs["wall"], "dataloader": warm_dl["wall"]}
    runs: dict[str, list[dict[str, Any]]] = {"hindsight": [], "DataLoader": []}
    for r in range(rounds):
        runs["hindsight"].append(timed_epoch(hs_epoch(loader, 1 + r), hs_pids))
        runs["DataLoader"].append(timed_epoch(iter(dl), dl_pids))
    del dl  # its workers exit

    def total(name: str, key: str) -> float:
        return float(sum(e[key] for e in runs[name]))

    rate = {k: total(k, "examples") / total(k, "wall") for k in runs}
    ratio = rate["hindsight"] / rate["DataLoader"]
    batches = {k: sum(len(e["times"]) for e in runs[k]) for k in runs}
    worker_ms = {k: 1000 * total(k, "workers") / batches[k] for k in runs}
    trainer_ms = {k: 1000 * total(k, "trainer") / batches[k] for k in runs}
    busy = {k: total(k, "workers") / (WORKERS * total(k, "wall")) for k in runs}
    others = {k: total(k, "others") / total(k, "wall") for k in runs}
    first = {k: statistics.median(e["times"][0] for e in runs[k]) for k in runs}
    raw["throughput"] = {
        k: [{x: e[x] for x in ("wall", "examples", "trainer", "workers", "others")} for e in v] for k, v in runs.items()
    }
    raw["per_batch_ms"] = {k: {"workers": worker_ms[k], "trainer": trainer_ms[k]} for k in runs}
    for k in runs:
        dups = sum(audit(e["indices"], n)[0] for e in runs[k])
        missing = sum(audit(e["indices"], n)[1] for e in runs[k])
        raw.setdefault("checks", []).append(f"{k}: {rounds} epochs, {dups} duplicated and {missing} missing examples")

    def ratio_of(a: float, b: float) -> str:
        return f"{a / b:.3f}" if b else "-"

    lines.append(
        f"1. throughput: {n} examples/epoch, batch {BATCH}, {WORKERS} workers; 1 warm-up + {rounds} measured epochs "
        "each, alternated"
    )
    rows = [
        ["examples/s", f"{rate['hindsight']:.0f}", f"{rate['DataLoader']:.0f}", f"{ratio:.3f}",
         verdict(ratio, THROUGHPUT_TARGET, True)],
        ["worker CPU per batch", f"{worker_ms['hindsight']:.1f} ms", f"{worker_ms['DataLoader']:.1f} ms",
         ratio_of(worker_ms["hindsight"], worker_ms["DataLoader"]), "both worker processes together"],
        ["trainer CPU per batch", f"{trainer_ms['hindsight']:.1f} ms", f"{trainer_ms['DataLoader']:.1f} ms",
         ratio_of(trainer_ms["hindsight"], trainer_ms["DataLoader"]), "this process, all threads (hindsight: + local dispatcher)"],
        ["workers busy", f"{100 * busy['hindsight']:.0f}%", f"{100 * busy['DataLoader']:.0f}%",
         ratio_of(busy["hindsight"], busy["DataLoader"]), "worker CPU-s / (wall-s x workers)"],
        ["other processes' load", f"{others['hindsight']:.2f}", f"{others['DataLoader']:.2f}", "-",
         "cores kept busy by the rest of the machine"],
        ["first batch of an epoch", f"{first['hindsight'] * 1000:.0f} ms", f"{first['DataLoader'] * 1000:.0f} ms",
         ratio_of(first["hindsight"], first["DataLoader"]), "median over measured epochs"],
    ]  # fmt: skip
    lines.append(table(["metric", "hindsight", "DataLoader", "ratio", "target / note"], rows))
    lines.append("  per measured epoch, in order: examples/s (CPU-s of workers | trainer | rest of the machine)")
    for k, v in runs.items():
        per = [f"{e['examples'] / e['wall']:5.0f} ({e['workers']:.1f}|{e['trainer']:.1f}|{e['others']:.1f})" for e in v]
        lines.append(f"    {k:<10} " + "  ".join(per))
    lines.append(
        f"  warm-up epochs (worker start-up included): hindsight {warm_hs['wall']:.1f} s, "
        f"DataLoader {warm_dl['wall']:.1f} s"
    )
    return loader, lines


def part_breakdown(raw: dict[str, Any]) -> list[str]:
    """Where the CPU of a batch goes: its worker-side parts timed in this
    process with one torch thread (as the workers run) - the dataset and
    collate (all a DataLoader worker runs of the user's code), the seeding
    of the global generators before each example, the unit codec - set
    against the CPU the worker processes and the trainer actually spent
    per batch in part 1. Each part is this thread's CPU time, the least of
    BREAKDOWN_REPS rounds: what the work costs, without what another
    process's load adds."""
    from hindsight.data._codec import decode, encode

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ds = data_pipelines.augmented(BATCH * BREAKDOWN_REPS)
        collate = torch.utils.data.default_collate
        seeds = [_native.data_example_seed(SEED, 0, i) for i in range(BATCH)]
        parts: dict[str, list[float]] = {k: [] for k in ("compute", "random", "numpy", "torch", "encode", "decode")}
        clock = time.thread_time
        for rep in range(BREAKDOWN_REPS):
            t0 = clock()
            batch = collate([ds[rep * BATCH + i] for i in range(BATCH)])
            t1 = clock()
            for s in seeds:
                random.seed(s)
            t2 = clock()
            for s in seeds:
                np.random.seed(s & 0xFFFF_FFFF)
            t3 = clock()
            for s in seeds:
                torch.default_generator.manual_seed(s)
            t4 = clock()
            payload = encode(batch)
            t5 = clock()
            decode(bytearray(payload))
            t6 = clock()
            for k, a, b in (("compute", t0, t1), ("random", t1, t2), ("numpy", t2, t3), ("torch", t3, t4),
                            ("encode", t4, t5), ("decode", t5, t6)):  # fmt: skip
                parts[k].append(b - a)
        torch.manual_seed(SEED)
    finally:
        torch.set_num_threads(threads)
    least = {k: min(v) * 1000 for k, v in parts.items()}
    raw["batch_parts_ms"] = least
    hs_w, dl_w = raw["per_batch_ms"]["hindsight"]["workers"], raw["per_batch_ms"]["DataLoader"]["workers"]
    hs_t, dl_t = raw["per_batch_ms"]["hindsight"]["trainer"], raw["per_batch_ms"]["DataLoader"]["trainer"]
    seeding = least["random"] + least["numpy"] + least["torch"]
    ms = "{:.1f} ms".format
    rows = [
        ["dataset + default_collate", ms(least["compute"]), ms(least["compute"]), "timed here"],
        ["seed random + numpy, x64", ms(least["random"] + least["numpy"]), "-", "timed here; before each example"],
        ["seed torch (default generator), x64", ms(least["torch"]), "-", "timed here; before each example"],
        ["encode (unit codec)", ms(least["encode"]), "-", f"timed here; {len(payload) / 2**20:.1f} MiB"],
        ["rest: measured - parts above", ms(hs_w - least["compute"] - seeding - least["encode"]), ms(dl_w - least["compute"]),
         "serving (digest, gRPC) / pickling to shm"],
        ["= worker CPU, measured in part 1", ms(hs_w), ms(dl_w), ""],
        ["trainer CPU, measured in part 1", ms(hs_t), ms(dl_t), "receive, digest, decode / unpickle"],
        ["  of which decode (+ copy to a bytearray)", ms(least["decode"]), "-", "timed here"],
    ]  # fmt: skip
    return [
        f"  where the CPU goes, per batch of {BATCH} ('timed here': this process, 1 torch thread, thread CPU time, "
        f"least of {BREAKDOWN_REPS}):",
        *("  " + line for line in table(["part", "hindsight", "DataLoader", "note"], rows).splitlines()),
    ]


# --------------------------------------------------------------------------
# part 2: a worker killed


def part_failover(loader: Loader, n: int, epoch: int, raw: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    base = timed_epoch(hs_epoch(loader, epoch), [])
    before = loader.stats()
    nbatches = len(loader)
    kill_batch = max(1, round(KILL_AT * nbatches))
    killed: dict[str, Any] = {}

    def watch_replacement(gone: list[int]) -> None:
        deadline = now() + 15
        while now() < deadline:
            if [p for p in loader.worker_pids() if p not in gone]:
                killed["replacement"] = now()
                return
            time.sleep(0.005)

    def on_batch(k: int) -> None:
        """Right after batch k arrived: kill, or note when units of a later attempt have arrived."""
        if k == kill_batch:
            pids = loader.worker_pids()
            os.kill(pids[0], signal.SIGKILL)
            killed["at"] = now()
            watcher = threading.Thread(target=watch_replacement, args=(pids,), daemon=True)
            watcher.start()
            killed["watcher"] = watcher
        elif k > kill_batch and "recomputed" not in killed:
            if loader.stats()["units_after_failover"] > before["units_after_failover"]:
                killed["recomputed"] = k

    run = timed_epoch(hs_epoch(loader, epoch + 1, on_batch), [])
    killed["watcher"].join()
    t_kill = killed["at"] - run["t0"]
    t_repl = killed["replacement"] - run["t0"] if "replacement" in killed else None
    stats = loader.stats()
    keys = ("failovers", "stalls_reported", "units_after_failover", "duplicates_dropped", "stale_dropped")
    delta = {k: stats[k] - before.get(k, 0) for k in (*keys, "workers_replaced")}
    times = run["times"]
    gaps = [b - a for a, b in zip([0.0, *times[:-1]], times, strict=True)]
    typical = base["wall"] / len(base["times"])  # the epoch before's mean gap
    # Around the kill: the deliveries after it up to the first one made
    # when units of the replacement attempt had arrived (batch numbers are
    # 1-based; gaps[k - 1] ends at batch k).
    first_after = killed.get("recomputed", nbatches)
    around = gaps[kill_batch:first_after]
    longest = max(around)
    detect = longest - typical
    t_recomputed = times[first_after - 1] - t_kill
    rest = gaps[first_after:]
    longest_rest = max(rest) if rest else 0.0
    lost = run["wall"] - base["wall"]
    dups, missing = audit(run["indices"], n)
    order_ok = all(
        [int(i) for i in got] == loader.spec.batch_indices(epoch + 1, b, 0, 1) for b, got in enumerate(run["indices"])
    )
    failover_s = float(stats["last_failover_seconds"])
    raw["failover"] = {
        "kill_at_s": t_kill,
        "kill_batch": kill_batch,
        "first_batch_after_recomputed_units": first_after,
        "gaps_s": gaps,
        "typical_gap_s": typical,
        "stats": stats,
        "baseline_wall_s": base["wall"],
        "wall_s": run["wall"],
        "replacement_started_s": t_repl,
    }
    lines.append(
        f"2. a worker killed: SIGKILL after batch {kill_batch} of {nbatches} ({t_kill:.2f} s into epoch {epoch + 1}; "
        f"{n} examples, local:{WORKERS}, {SPLIT_BATCHES} batches per split)"
    )
    rows = [
        ["detection + failover: longest gap around the kill - typical", f"{detect:.3f} s",
         verdict(detect, FAILOVER_TARGET_S, False)],
        ["client's last_failover_seconds", f"{failover_s:.3f} s", verdict(failover_s, FAILOVER_TARGET_S, False)],
        ["typical gap between batches", f"{typical * 1000:.0f} ms", "mean of the epoch before (no kill)"],
        ["kill -> first batch after recomputed units arrived", f"{t_recomputed:.3f} s",
         f"batch {first_after}; 'around the kill' = batches {kill_batch + 1}..{first_after}"],
        ["longest gap later in the epoch", f"{longest_rest:.3f} s", "one worker until the replacement serves"],
        ["total stall: epoch time lost to the kill", f"{lost:.2f} s",
         f"{run['wall']:.2f} s vs {base['wall']:.2f} s for the epoch before"],
        ["replacement worker process started", "-" if t_repl is None else f"{t_repl - t_kill:.2f} s",
         "after the kill (then imports torch, registers)"],
        ["failovers / stalls reported", f"{delta['failovers']} / {delta['stalls_reported']}", "this epoch"],
        ["units_after_failover", f"{delta['units_after_failover']}", "units delivered by a later attempt"],
        ["duplicate units dropped by the client", f"{delta['duplicates_dropped']}",
         f"stale (fenced) units dropped: {delta['stale_dropped']}"],
        ["workers replaced", f"{delta['workers_replaced']}", ""],
        ["duplicated examples delivered", f"{dups}", "must be 0: " + ("ok" if dups == 0 else "FAIL")],
        ["missing examples", f"{missing}", "must be 0: " + ("ok" if missing == 0 else "FAIL")],
        ["order as (seed, epoch) fixes it", "yes" if order_ok else "NO", "every batch's indices"],
        ["nondeterministic recomputations", f"{stats.get('nondeterministic', 0)}",
         "recomputed unit's digest differs"],
    ]  # fmt: skip
    lines.append(table(["metric", "value", "target / note"], rows))
    raw.setdefault("checks", []).append(
        f"kill epoch: {dups} duplicated, {missing} missing examples, order {'as fixed' if order_ok else 'WRONG'}"
    )
    lines.append(plot(base, run, t_kill, t_repl))
    return lines


def plot(base: dict[str, Any], run: dict[str, Any], t_kill: float, t_repl: float | None) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "  (matplotlib not installed: no plot; `pip install -r requirements-bench.txt`)"

    def binned(e: dict[str, Any]) -> tuple[list[float], list[float]]:
        nb = int(e["wall"] / BIN_S) + 1
        counts = [0.0] * nb
        for t, idx in zip(e["times"], e["indices"], strict=True):
            counts[min(int(t / BIN_S), nb - 1)] += idx.numel()
        return [(i + 0.5) * BIN_S for i in range(nb)], [c / BIN_S for c in counts]

    def smooth(y: list[float], k: int = 4) -> list[float]:
        """Mean over k bins (1 s), centred."""
        h = k // 2
        return [sum(y[max(0, i - h) : i + h]) / len(y[max(0, i - h) : i + h]) for i in range(len(y))]

    fig, ax = plt.subplots(figsize=(9, 4))
    x, y = binned(base)
    ax.plot(x, smooth(y), color="0.55", linestyle="--", label="epoch before (no kill), 1 s mean")
    x, y = binned(run)
    ax.bar(x, y, width=BIN_S, color="C0", alpha=0.35, label=f"epoch with a worker killed, {BIN_S} s bins")
    ax.plot(x, smooth(y), color="C0", label="epoch with a worker killed, 1 s mean")
    ax.axvline(t_kill, color="C3", label="SIGKILL of a worker")
    if t_repl is not None:
        ax.axvline(t_repl, color="C2", linestyle=":", label="replacement process started")
    ax.set_xlabel("time since the start of the epoch (s)")
    ax.set_ylabel("examples/s delivered")
    ax.set_title(f"hs.data.Loader, local:{WORKERS}, batch {BATCH}: throughput across a worker kill")
    ax.set_xlim(0, max(run["wall"], base["wall"]))
    ax.set_ylim(0, 1.45 * ax.get_ylim()[1])
    ax.legend(loc="upper center", ncol=2, fontsize=8)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=120)
    plt.close(fig)
    return f"  plot: {PLOT.relative_to(REPO)}"


# --------------------------------------------------------------------------
# part 3: journal replay


def start_worker(address: str, n: int) -> subprocess.Popen[bytes]:
    """A remote-style worker; the token is this process's (``make_journal``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
    return subprocess.Popen(
        [sys.executable, "-m", "hindsight", "data", "worker", "--dispatcher", address,
         "--dataset", "data_pipelines:tiny", "--args", json.dumps({"n": n}), "--bind", "127.0.0.1:0",
         "--parent-pid", str(os.getpid())],
        env=env,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip


def open_dispatcher(journal: Path) -> tuple[_native.DataDispatcher, float, float]:
    """Start a dispatcher on ``journal`` (it replays the journal): the
    dispatcher, the seconds the successful start took, and how long starts
    were refused before it because the previous dispatcher's lock was still
    held."""
    first = now()
    deadline = first + 10
    while True:
        t0 = now()
        try:
            d = _native.DataDispatcher(journal)
            # Waited only if a start was refused (t0 moved on from the first try).
            return d, now() - t0, t0 - first if t0 > first + 1e-3 else 0.0
        except StorageError as e:
            if "in use" not in str(e) or now() > deadline:
                raise
            time.sleep(0.002)


def make_journal(journal: Path, n: int, window: int | None) -> dict[str, Any]:
    d = _native.DataDispatcher(journal)
    # Its workers and this trainer give its token, as remote ones would.
    os.environ["HINDSIGHT_DATA_TOKEN"] = d.token
    workers = [start_worker(d.address, n) for _ in range(WORKERS)]
    try:
        with Loader(
            data_pipelines.tiny,
            batch_size=1,
            split_batches=1,
            seed=SEED,
            workers=d.address,
            dataset_args={"n": n},
            window=window,
        ) as loader:
            it = iter(loader)
            first = next(it)  # waits for the workers to start
            t0 = now()
            seen = [int(first[0])] + [int(b[0]) for b in it]
            secs = now() - t0
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        d.stop()
    return {
        "seconds": secs,
        "rate": (n - 1) / secs,
        "duplicates": len(seen) - len(set(seen)),
        "missing": n - len(set(seen)),
    }


def part_journal(sizes: list[int], raw: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    rows: list[list[str]] = []
    results: list[dict[str, Any]] = []
    # The default window of a remote loader (8 splits), for scale.
    small = SCRATCH / "journal-default-window"
    default = make_journal(small, sizes[0], None)
    for n in sizes:
        journal = SCRATCH / f"journal-{n}"
        made = make_journal(journal, n, JOURNAL_WINDOW)
        path = journal / "journal.hsj"
        size = path.stat().st_size
        times, waits = [], []
        for _ in range(REPLAY_REPS):
            d, secs, waited = open_dispatcher(journal)
            d.stop()
            times.append(secs)
            waits.append(waited)
        if path.stat().st_size != size:
            raw.setdefault("checks", []).append(
                f"journal of {n} splits changed size on replay: {size} -> {path.stat().st_size}"
            )
        # Let the last dispatcher release the lock before the directory goes.
        d, _, _ = open_dispatcher(journal)
        d.stop()
        results.append({"splits": n, "bytes": size, "replay_s": times, "lock_waits_s": waits, "made": made})
        rows.append([
            f"{n}", f"{size / 2**20:.2f} MiB", f"{size / n:.0f} B", f"{statistics.median(times) * 1000:.1f} ms",
            f"{min(times) * 1000:.1f} ms", f"{statistics.median(times) / n * 1e6:.2f} us",
            f"{made['seconds']:.1f} s ({made['rate']:.0f}/s)",
        ])  # fmt: skip
        raw.setdefault("checks", []).append(
            f"journal job of {n} splits: {made['duplicates']} duplicated, {made['missing']} missing examples"
        )
    raw["journal"] = results
    raw["journal_default_window"] = default
    lines.append(
        f"3. journal replay: one epoch of N one-example splits (batch 1, split_batches=1), 2 workers; "
        f"dispatcher start on the journal, {REPLAY_REPS} times"
    )
    lines.append(
        table(
            ["splits", "journal", "per split", "replay (median)", "replay (min)", "per split", "producing it"],
            rows,
        )
    )
    waits = [w for r in results for w in r["lock_waits_s"]]
    refused = sum(1 for w in waits if w > 0)
    lines.append(
        f"  producing: window={JOURNAL_WINDOW} splits in flight; with a remote loader's default window (8), "
        f"{sizes[0]} splits took {default['seconds']:.1f} s ({default['rate']:.0f} splits/s)"
    )
    if refused:
        lines.append(
            f"  note: {refused} of {len(waits)} starts right after DataDispatcher.stop() were refused (StorageError: "
            f"journal in use; the stopped dispatcher's lock is released in the background, up to "
            f"{max(waits) * 1000:.0f} ms later) and retried; only the successful start is timed"
        )
    return lines


# --------------------------------------------------------------------------


CKPT_COUNTS = [60] * 8  # records per shard (part 4)
CKPT_BATCH, CKPT_SPLIT = 8, 24
CKPT_KILLS = 3  # epochs with a kill, per case
CKPT_KILL_AT = 44  # batch (of 60) after which the worker is killed: late in split 1 (24-47)


def part_checkpoints(raw: dict[str, Any]) -> list[str]:
    sys.path.insert(0, str(REPO / "tests"))
    import data_synth

    rows = []
    results: dict[str, Any] = {}
    cases = (
        (0.0, 256 << 10, "free read, 256 KiB records"),
        (2.0, 0, "costly read (2 ms/record)"),
    )
    for read_ms, record_bytes, kind in cases:
        for overhead in (0.0, 0.05):
            log = SCRATCH / f"ckpt-{read_ms}-{record_bytes}-{overhead}.log"
            args = {
                "counts": CKPT_COUNTS, "open_log": str(log), "read_ms": read_ms, "transform_ms": 1.0,
                "record_bytes": record_bytes,
            }  # fmt: skip
            with Loader(
                data_synth.stream, batch_size=CKPT_BATCH, seed=SEED, workers="local:1", split_batches=CKPT_SPLIT,
                dataset_args=args, checkpoint_overhead=overhead,
            ) as loader:  # fmt: skip
                times, scanned, resumes = [], [], 0
                for epoch in range(2 + CKPT_KILLS):
                    log.write_text("")
                    loader.set_epoch(epoch)
                    t0, n = now(), 0
                    for _ in loader:
                        n += 1
                        if epoch >= 2 and n == CKPT_KILL_AT:
                            os.kill(loader.worker_pids()[0], signal.SIGKILL)
                    times.append(now() - t0)
                    lines = log.read_text().split("\n")
                    scanned.append(sum(int(x.split()[2]) for x in lines if x.startswith("open ")))
                    resumes += sum(1 for x in lines if x.startswith("resume ")) if epoch >= 2 else 0
            r = {
                "no_kill_s": times[1], "kill_s": statistics.median(times[2:]), "scanned_no_kill": scanned[1],
                "scanned_kill": statistics.median(scanned[2:]), "resumes": resumes,
            }  # fmt: skip
            results[f"{read_ms}/{record_bytes}/{overhead}"] = r
            rows.append([
                kind, "never" if overhead == 0 else "policy (5%)", f"{r['no_kill_s']:.2f} s", f"{r['kill_s']:.2f} s",
                f"{r['scanned_no_kill']} / {r['scanned_kill']:.0f}", str(resumes),
            ])  # fmt: skip
    raw["worker_checkpoints"] = results
    head = (
        f"4. worker checkpoints: {sum(CKPT_COUNTS)} records in {len(CKPT_COUNTS)} shards that cannot seek, batch "
        f"{CKPT_BATCH}, {CKPT_SPLIT} batches per split, local:1; in each of {CKPT_KILLS} epochs the worker is "
        f"SIGKILLed after batch {CKPT_KILL_AT}, late in a split (the loader replaces it; its start-up is in the time)"
    )
    headers = ["pipeline", "checkpoints", "epoch, no failure", "epoch, worker killed (median)",
               "records read to seek (no failure / killed)", f"reader resumes in {CKPT_KILLS} kills"]  # fmt: skip
    return [head, *table(headers, rows).splitlines()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=6144, help="examples per epoch in parts 1-2 (default 6144)")
    ap.add_argument("--rounds", type=int, default=3, help="measured epochs per loader in part 1 (default 3)")
    ap.add_argument("--splits", default="1000,10000,50000", help="journal sizes of part 3 (default 1000,10000,50000)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()
    sizes = [int(s) for s in args.splits.split(",") if s]

    shutil.rmtree(SCRATCH, ignore_errors=True)
    SCRATCH.mkdir(parents=True)
    started = now()
    cpu0 = cpu_snapshot()
    raw: dict[str, Any] = {}
    loader: Loader | None = None
    try:
        info = machine_info()
        print("hindsight input service benchmark (one run; timings from time.perf_counter)")
        print(
            f"  machine    {info['cpu']} ({info['cpu_capability']}), {info['cores']} cores"
            f"{', ' + format(info['ram_bytes'] / (1 << 30), '.0f') + ' GiB RAM' if info['ram_bytes'] else ''}"
        )
        print(
            f"  torch      {info['torch']} (trainer: {info['torch_threads']} threads; workers of both loaders: 1), "
            f"python {info['python']}, kernel {info['kernel']}"
        )
        print(f"  git        {info['git']}")
        print(
            f"  workload   data_pipelines.augmented: 3x96x96 -> 3x80x80 float32, batch {BATCH} "
            f"({BATCH * 3 * 80 * 80 * 4 / 2**20:.1f} MiB), {WORKERS} workers, split_batches={SPLIT_BATCHES}"
        )
        print(flush=True)

        t0 = now()
        loader, lines = part_throughput(args.examples, args.rounds, raw)
        lines += part_breakdown(raw)
        print("\n".join(lines), flush=True)
        print(f"  (part 1 took {now() - t0:.0f} s)", file=sys.stderr, flush=True)
        print()

        t0 = now()
        lines = part_failover(loader, args.examples, 1 + args.rounds, raw)
        loader.close()
        loader = None
        print("\n".join(lines), flush=True)
        print(f"  (part 2 took {now() - t0:.0f} s)", file=sys.stderr, flush=True)
        print()

        t0 = now()
        lines = part_journal(sizes, raw)
        print("\n".join(lines), flush=True)
        print(f"  (part 3 took {now() - t0:.0f} s)", file=sys.stderr, flush=True)
        print()

        t0 = now()
        lines = part_checkpoints(raw)
        print("\n".join(lines), flush=True)
        print(f"  (part 4 took {now() - t0:.0f} s)", file=sys.stderr, flush=True)
        print()

        print("checks:")
        for c in raw.get("checks", []):
            print(f"  {c}")
        busy, steal, own = (b - a for a, b in zip(cpu0, cpu_snapshot(), strict=True))
        wall = now() - started
        other = max(0.0, busy - own)
        cores = os.cpu_count() or 1
        print(
            f"CPU: this benchmark {own:.0f} CPU-s; rest of the machine {other:.0f} CPU-s = "
            f"{100 * other / (wall * cores):.0f}% of {cores} cores; hypervisor steal {steal:.0f} s"
        )
        if other > 0.10 * wall * cores or steal > 0.05 * wall * cores:
            print("WARNING: the machine was not idle during the run; timings are disturbed.")
        print(f"total run time {wall:.0f} s")
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": info, "raw": raw}, indent=1, default=str))
    finally:
        if loader is not None:
            with contextlib.suppress(Exception):
                loader.close()
        shutil.rmtree(SCRATCH, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

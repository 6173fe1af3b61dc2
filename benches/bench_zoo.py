"""The zoo at real epoch lengths: what recording costs and what replay saves
on public training scripts, against the plain script, in one run.

    make bench                      # runs this after bench_replay.py
    python benches/bench_zoo.py [--scripts mnist vae siamese_network] [--epochs 5] [--epoch-s 5]

Each script (tests/zoo/, adapted as the README tells users) is first
calibrated: the second epoch of a small recording gives the seconds per
training example, and the training set is scaled so that one epoch takes
about --epoch-s seconds. Then, at that size, with one torch thread:

    plain    the script with hindsight replaced by the zoo's no-op shim
    record   the script as adapted, default adaptive policy (no
             $HINDSIGHT_CHECKPOINT_EVERY): process CPU against plain
    epoch    the zoo's epoch probe added, `hindsight replay -q --strict`:
             whole command against the whole recording command
    step     the zoo's step probe added, replayed over the last 20% of the
             epochs (`--where`), `-j` the machine's cores: against the
             recording

Targets (issue 41): record <= 1.03x CPU, an epoch probe >= 10x faster than
the recording, a step probe over the last 20% >= 4x faster. A replay that
exits nonzero or leaves a probed epoch without its value is a problem, and
the benchmark exits 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from hindsight import _native

from benchutil import REPO, Table, machine_info, run

sys.path.insert(0, str(REPO / "tests" / "zoo"))
import driver  # the zoo's script preparation, probes and no-op shim

OUT = REPO / "bench-out" / "zoo"
PY = sys.executable
RECORD_TARGET = 1.03
EPOCH_TARGET = 0.10
STEP_TARGET = 0.25
CALIBRATION_SIZE = 2048
SCRIPTS = ("mnist", "vae", "siamese_network")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("HINDSIGHT_")}
    return {**e, **ONE_THREAD, **extra}


def cpu_of(fn: Any) -> tuple[dict[str, Any], float]:
    """(run's result, the CPU seconds of the processes it started)."""
    c0 = os.times()
    r = fn()
    c1 = os.times()
    return r, (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system)


def epochs_recorded(home: Path) -> list[Any]:
    db = _native.LogDb(str(home / "logs.db"))
    run_id = db.latest_run()["id"]
    loops = db.outer_loops(run_id)
    return db.iterations(run_id, loops[0]) if loops else []


def values_of(home: Path, name: str) -> int:
    db = _native.LogDb(str(home / "logs.db"))
    run_id = db.latest_run()["id"]
    return len(db.values(run_id, [name]))


def bench_script(name: str, epochs: int, epoch_s: float, tab: Table, raw: dict[str, Any]) -> list[str]:
    spec = driver.SCRIPTS[name]
    d = OUT / name
    shim = driver.shim_dir(d)
    problems: list[str] = []

    # Calibrate: seconds per example from the second of two small recorded
    # epochs (the first pays for warm-up).
    cal = d / "calibrate"
    script = driver.prepare(cal, spec)
    run(  # raises, with its output, on a nonzero exit (as the plain and recorded runs do)
        [PY, script.name, "--epochs", "2", "--train-size", str(CALIBRATION_SIZE)],
        cal,
        env(HINDSIGHT_HOME=str(cal / ".hindsight")),
        f"{name} calibration",
    )
    per_example = epochs_recorded(cal / ".hindsight")[-1].seconds / CALIBRATION_SIZE
    size = int(math.ceil(epoch_s / per_example / 64) * 64)
    args = ["--epochs", str(epochs), "--train-size", str(size)]

    plain_dir, rec_dir = d / "plain", d / "rec"
    plain_script = driver.prepare(plain_dir, spec)
    rec_script = driver.prepare(rec_dir, spec)
    pp = os.pathsep.join([str(shim), *filter(None, [os.environ.get("PYTHONPATH")])])
    plain, plain_cpu = cpu_of(
        lambda: run([PY, plain_script.name, *args], plain_dir, env(PYTHONPATH=pp), f"{name} plain")
    )
    home = rec_dir / ".hindsight"
    rec, rec_cpu = cpu_of(
        lambda: run([PY, rec_script.name, *args], rec_dir, env(HINDSIGHT_HOME=str(home)), f"{name} record")
    )
    iters = epochs_recorded(home)
    took = sum(1 for it in iters if it.checkpoint is not None)
    mean_epoch = sum(it.seconds for it in iters) / max(len(iters), 1)

    def replay(kind: str, *extra: str) -> tuple[dict[str, Any], float]:
        rec_script.write_text(driver.with_probes((driver.ZOO / spec.file).read_text(), (kind,)))
        return cpu_of(
            lambda: run(
                [PY, "-m", "hindsight", "replay", rec_script.name, "-q", "--strict", *extra],
                rec_dir,
                env(HINDSIGHT_HOME=str(home)),
                f"{name} {kind} replay",
                ok=(0, 1, 3),
            )
        )

    ep, ep_cpu = replay("epoch")
    first_late = epochs - max(1, epochs // 5)
    st, st_cpu = replay("step", "--where", f"epoch >= {first_late}", "-j", str(os.cpu_count() or 1))
    got_epoch, got_step = values_of(home, "zoo_epoch"), values_of(home, "zoo_step")
    for kind, p, n in (("epoch", ep, got_epoch), ("step", st, got_step)):
        if p["rc"] != 0 or n == 0:
            problems.append(f"{name} {kind} replay exited {p['rc']} with {n} values: {p['stderr'][-1500:]}")

    tab.section(
        f"{name} ({spec.file}): {epochs} epochs of {size} examples, {mean_epoch:.1f} s an epoch recorded, "
        f"{took} checkpoints"
    )
    tab.add("record: process CPU (vs plain)", rec_cpu, plain_cpu, target=RECORD_TARGET)
    tab.add("record: whole command (vs plain)", rec["wall_s"], plain["wall_s"])
    tab.add(
        "epoch probe replayed: whole command (vs the recording)",
        ep["wall_s"],
        rec["wall_s"],
        target=EPOCH_TARGET,
        note=f"{rec['wall_s'] / ep['wall_s']:.1f}x faster; {benchutil_summary(ep['stdout'])}",
    )
    tab.add(
        f"step probe, epochs >= {first_late}: whole command (vs the recording)",
        st["wall_s"],
        rec["wall_s"],
        target=STEP_TARGET,
        note=f"{rec['wall_s'] / st['wall_s']:.1f}x faster; {benchutil_summary(st['stdout'])}",
    )
    raw[name] = {
        "train_size": size,
        "epochs": epochs,
        "epoch_s": mean_epoch,
        "checkpoints": took,
        "plain_wall_s": plain["wall_s"],
        "plain_cpu_s": plain_cpu,
        "rec_wall_s": rec["wall_s"],
        "rec_cpu_s": rec_cpu,
        "epoch_replay_wall_s": ep["wall_s"],
        "epoch_replay_cpu_s": ep_cpu,
        "step_replay_wall_s": st["wall_s"],
        "step_replay_cpu_s": st_cpu,
        "epoch_replay": ep["stdout"].strip().splitlines()[-2:],
        "step_replay": st["stdout"].strip().splitlines()[-2:],
    }
    return problems


def benchutil_summary(stdout: str) -> str:
    """The replay's own account: restores and executed steps."""
    for line in stdout.splitlines():
        if line.startswith("replayed "):
            return line.split(": ", 1)[1].split(";")[0]
    return "no summary line"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scripts", nargs="+", default=list(SCRIPTS), choices=sorted(driver.SCRIPTS))
    ap.add_argument(
        "--epochs", type=int, default=5, help="epochs of each run (default 5; the last 20%% is step-probed)"
    )
    ap.add_argument("--epoch-s", type=float, default=5.0, help="seconds an epoch should take (default 5)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--keep", action="store_true", help="leave bench-out/zoo/ in place")
    args = ap.parse_args()
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    info = machine_info()
    print("hindsight zoo benchmark (one run per measurement, fresh processes, one torch thread)")
    print(f"  cpu        {info['cpu']}, {info['cores']} cores; torch {info['torch']}; git {info['git']}")
    tab = Table()
    raw: dict[str, Any] = {}
    problems: list[str] = []
    try:
        for name in args.scripts:
            problems += bench_script(name, args.epochs, args.epoch_s, tab, raw)
        print(tab.render())
        for p in problems:
            print(f"PROBLEM: {p}")
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": info, "results": raw, "problems": problems}, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(OUT, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

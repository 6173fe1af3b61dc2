"""The main job: record a real training run, then question it by replay.

1. records examples/train.py (logs, arguments, source, and the checkpoints
   the adaptive policy finds worth their cost);
2. adds `hs.log("weight_norm", ...)` after the epoch's training steps and
   replays: an epoch with a checkpoint is restored, its training steps
   skipped (partial replay);
3. adds `hs.log("grad_norm", ...)` inside the step loop and replays with two
   workers (parallel replay);
4. prints the recorded and replayed values side by side, and what happened:
   every sentence of that summary comes from the run's numbers (checkpoints
   taken, epochs restored, steps executed, workers used, times).

    python examples/demo.py [--dir .hindsight-demo]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def shown(cmd: list[str]) -> str:
    """The command as a user would paste it in the project directory:
    `python train.py ...`, `hindsight replay ...`, quoted where needed."""
    if cmd[:3] == [sys.executable, "-m", "hindsight"]:
        cmd = ["hindsight", *cmd[3:]]
    elif cmd[0] == sys.executable:
        cmd = ["python", *cmd[1:]]
    return shlex.join(cmd)


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, str]:
    """Run `cmd`, showing its output; (wall seconds, its stdout)."""
    print("$", shown(cmd), flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=cwd, check=True, stdout=subprocess.PIPE, text=True)
    print(r.stdout, end="", flush=True)
    return time.perf_counter() - t0, r.stdout


class Replayed:
    """What a replay reported: its kind, workers, restores and executed steps."""

    def __init__(self, stdout: str) -> None:
        kind = re.search(r"(partial|parallel) replay of .* on (\d+) worker", stdout)
        done = re.search(
            r"replayed (\d+) iteration\(s\) in [\d.]+s: (\d+) restored from checkpoints, (\d+) inner", stdout
        )
        if kind is None or done is None:
            raise SystemExit(f"demo: the replay's summary was not found in its output:\n{stdout}")
        self.kind, self.workers = kind[1], int(kind[2])
        self.iterations, self.restored, self.steps = int(done[1]), int(done[2]), int(done[3])


def checkpoints_of(hindsight: list[str], env: dict[str, str], cwd: Path) -> tuple[str, int]:
    """The latest run's id and how many checkpoints it took (`hindsight runs`, `hindsight ls`)."""
    runs = json.loads(
        subprocess.run(
            [*hindsight, "runs", "--json"], env=env, cwd=cwd, check=True, capture_output=True, text=True
        ).stdout
    )
    listed = json.loads(
        subprocess.run(
            [*hindsight, "ls", "--json"], env=env, cwd=cwd, check=True, capture_output=True, text=True
        ).stdout
    )
    run_id = runs[0]["id"]
    return run_id, sum(1 for c in listed if c.get("meta", {}).get("run") == run_id)


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=".hindsight-demo", help="scratch project directory (recreated)")
    ap.add_argument("--epochs", default="10")
    # Epochs of about a second here: what a checkpoint costs is then small
    # beside an epoch, and a replay's fixed start-up beside the recording.
    ap.add_argument("--model", default="--width 1024 --depth 2 --batches 256", help="train.py's size arguments")
    args = ap.parse_args()
    proj = Path(args.dir).resolve()
    shutil.rmtree(proj, ignore_errors=True)
    proj.mkdir(parents=True)
    script = proj / "train.py"
    shutil.copy(HERE / "train.py", script)
    env = {**os.environ, "HINDSIGHT_HOME": str(proj / ".hindsight")}
    hindsight = [sys.executable, "-m", "hindsight"]

    print(f"== the commands below run in {proj}, with HINDSIGHT_HOME={proj / '.hindsight'}")
    print(f"$ cd {shlex.quote(str(proj))} && export HINDSIGHT_HOME={shlex.quote(str(proj / '.hindsight'))}")
    print("== 1. record")
    t_record, _ = run([sys.executable, script.name, "--epochs", args.epochs, *shlex.split(args.model)], env, proj)
    run_id, taken = checkpoints_of(hindsight, env, proj)
    epochs = int(args.epochs)

    print("== 2. add an outer-loop probe and replay (partial)")
    src = script.read_text()
    src = src.replace(
        "        sched.step()\n",
        "        sched.step()\n"
        '        hs.log("weight_norm", sum(p.norm().item() ** 2 for p in net.parameters()) ** 0.5)\n',
        1,
    )
    script.write_text(src)
    t_partial, out = run([*hindsight, "replay", script.name, "-q", "--strict"], env, proj)
    partial = Replayed(out)

    half = int(args.epochs) // 2
    print(f"== 3. add an inner-loop probe and replay on 2 workers (parallel), epochs >= {half} only")
    src = src.replace(
        "            opt.step()\n",
        '            hs.log("grad_norm", sum(p.grad.norm().item() ** 2 '
        "for p in net.parameters()) ** 0.5)\n            opt.step()\n",
        1,
    )
    script.write_text(src)
    t_parallel, out = run(
        [*hindsight, "replay", script.name, "-q", "-j", "2", "--where", f"epoch >= {half}", "--strict"], env, proj
    )
    parallel = Replayed(out)

    print("== 4. the run, questioned")
    code = (
        "import hindsight as hs\n"
        "df = hs.dataframe('val_acc', 'weight_norm')\n"
        "print(df[df.columns[1:]].to_string(index=False))\n"
        "g = hs.dataframe('loss', 'grad_norm')\n"
        "print(g[g.grad_norm.notna()].groupby('epoch')[['loss', 'grad_norm']].mean().to_string())\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, cwd=proj, check=True)
    subprocess.run([*hindsight, "runs"], env=env, cwd=proj, check=True)
    print("== what was recorded and what was replayed")
    print(
        f"recorded while training: loss, val_acc (and the arguments, the source, "
        f"{plural(taken, 'checkpoint')} in {plural(epochs, 'epoch')}: run {run_id})"
    )
    if partial.restored == partial.iterations and partial.steps == 0:
        how = "every epoch restored from its checkpoint: no training step ran"
    else:
        how = (
            f"{partial.restored} of {plural(partial.iterations, 'epoch')} restored from checkpoints, "
            f"{plural(partial.steps, 'training step')} re-executed for the epochs without one"
        )
    print(f"computed afterwards by replay: weight_norm ({how})")
    print(
        f"                               grad_norm (epochs >= {half}: {plural(parallel.steps, 'training step')} "
        f"re-executed on {plural(parallel.workers, 'worker')}, {parallel.restored} started from a checkpoint)"
    )
    share = t_partial / t_record
    print(
        f"record {t_record:.1f} s; re-training to get weight_norm would take as long, the partial replay took "
        f"{t_partial:.1f} s ({share:.0%}); the parallel replay of half the epochs took "
        f"{t_parallel:.1f} s ({t_parallel / t_record:.0%}). Wall times, including Python and torch start-up."
    )
    if taken < epochs:
        every = os.environ.get("HINDSIGHT_CHECKPOINT_EVERY", "").strip()
        why = (
            f"HINDSIGHT_CHECKPOINT_EVERY={every} set the period"
            if every
            else "the adaptive policy took those whose cost fit within its bound on the recording's time "
            "(HINDSIGHT_VERBOSE=1 prints each decision; a busy machine makes checkpoints dearer)"
        )
        print(f"why not every epoch: {plural(taken, 'checkpoint')} in {plural(epochs, 'epoch')}: {why}")


if __name__ == "__main__":
    main()

"""The main job: record a real training run, then question it by replay.

1. records examples/train.py (logs, arguments, source, per-epoch checkpoints);
2. adds `hs.log("weight_norm", ...)` after the epoch's training steps and
   replays: the training steps are skipped, each epoch restored from its
   checkpoint (partial replay);
3. adds `hs.log("grad_norm", ...)` inside the step loop and replays with two
   workers (parallel replay);
4. prints the recorded and replayed values side by side.

    python examples/demo.py [--dir .hindsight-demo]
"""

from __future__ import annotations

import argparse
import os
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


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> float:
    print("$", shown(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=cwd, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=".hindsight-demo", help="scratch project directory (recreated)")
    ap.add_argument("--epochs", default="10")
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
    t_record = run([sys.executable, script.name, "--epochs", args.epochs, "--batches", "64"], env, proj)

    print("== 2. add an outer-loop probe and replay (partial)")
    src = script.read_text()
    src = src.replace(
        "        sched.step()\n",
        "        sched.step()\n"
        '        hs.log("weight_norm", sum(p.norm().item() ** 2 for p in net.parameters()) ** 0.5)\n',
        1,
    )
    script.write_text(src)
    t_partial = run([*hindsight, "replay", script.name, "-q", "--strict"], env, proj)

    half = int(args.epochs) // 2
    print(f"== 3. add an inner-loop probe and replay on 2 workers (parallel), epochs >= {half} only")
    src = src.replace(
        "            opt.step()\n",
        '            hs.log("grad_norm", sum(p.grad.norm().item() ** 2 '
        "for p in net.parameters()) ** 0.5)\n            opt.step()\n",
        1,
    )
    script.write_text(src)
    t_parallel = run(
        [*hindsight, "replay", script.name, "-q", "-j", "2", "--where", f"epoch >= {half}", "--strict"], env, proj
    )

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
    print("recorded while training: loss, val_acc (and the arguments, the source, a checkpoint per epoch)")
    print("computed afterwards by replay: weight_norm (every epoch, from its checkpoint: no training step ran)")
    print(f"                               grad_norm (epochs >= {half}, their training steps re-executed on 2 workers)")
    print(
        f"record {t_record:.1f} s; re-training to get weight_norm would take as long, the partial replay took "
        f"{t_partial:.1f} s ({t_partial / t_record:.0%}); the parallel replay of half the epochs took "
        f"{t_parallel:.1f} s ({t_parallel / t_record:.0%}). Wall times, including Python and torch start-up."
    )


if __name__ == "__main__":
    main()

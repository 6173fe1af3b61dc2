"""The main job (`make example`: examples/demo.py) says only what happened:
its summary follows the run's numbers (the checkpoints in the store, the
replays' own reports), whatever the checkpoints were."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, hindsight_cmd


@pytest.mark.parametrize("every", ["1", "2"])
def test_the_demo_summary_follows_the_numbers(tmp_path: Path, every: str) -> None:
    proj = tmp_path / "demo"
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "demo.py"),
            "--dir",
            str(proj),
            "--epochs",
            "4",
            "--model",
            "--batches 4",
        ],
        env={**os.environ, "HINDSIGHT_CHECKPOINT_EVERY": every},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out, summary = r.stdout.split("== what was recorded and what was replayed\n", 1)
    listed = subprocess.run(
        [*hindsight_cmd(), "ls", "--json"],
        env={**os.environ, "HINDSIGHT_HOME": str(proj / ".hindsight")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    taken = len(json.loads(listed.stdout))
    assert taken == 4 // int(every)
    assert f"{taken} checkpoints in 4 epochs" in summary, summary
    assert ("why not every epoch" in summary) == (taken < 4), summary
    if taken < 4:
        assert f"HINDSIGHT_CHECKPOINT_EVERY={every} set the period" in summary, summary

    # The replays' own reports, partial then parallel.
    workers = [int(w) for w in re.findall(r"replay of .* on (\d+) worker", out)]
    done = [
        tuple(map(int, m))
        for m in re.findall(
            r"replayed (\d+) iteration\(s\) in [\d.]+s: (\d+) restored from checkpoints, (\d+) inner", out
        )
    ]
    assert len(workers) == len(done) == 2, out
    (n, restored, steps), (_, p_restored, p_steps) = done
    if restored == n and steps == 0:
        assert "every epoch restored from its checkpoint: no training step ran" in summary, summary
    else:
        assert "no training step ran" not in summary, summary
        assert f"{restored} of {n} epochs restored from checkpoints, {steps} training steps re-executed" in summary
    assert f"epochs >= 2: {p_steps} training steps re-executed on {workers[1]} worker" in summary, summary
    assert f"{p_restored} started from a checkpoint" in summary, summary

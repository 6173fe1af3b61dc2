"""Multi-rank launches (issue 25 builds runs that span ranks). Until then a
recording under several ranks is refused before anything is recorded: each
rank would record its own run, and a rerun would resume every rank from one
rank's run with their logs mixed (wrong results with exit 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import hindsight_cmd

SCRIPT = """
import torch, hindsight as hs
m = torch.nn.Linear(2, 2)
with hs.checkpointing(model=m):
    for epoch in hs.loop("epoch", range(2)):
        hs.log("w", m.weight.sum().item())
"""


def test_a_torchrun_launch_of_two_ranks_is_refused_and_records_nothing(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    home = tmp_path / ".hindsight"
    env = {**os.environ, "HINDSIGHT_HOME": str(home), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode != 0
    assert "a recording under 2 ranks (RANK/WORLD_SIZE (torchrun) = " in r.stderr, r.stderr
    runs = subprocess.run(
        [*hindsight_cmd(), "--home", str(home), "runs", "--json"], capture_output=True, text=True, timeout=60
    )
    assert runs.returncode != 0 or json.loads(runs.stdout) == [], runs.stdout
    # One rank of one (torchrun --nproc_per_node=1) records as a plain run does.
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    runs = subprocess.run(
        [*hindsight_cmd(), "--home", str(home), "runs", "--json"], capture_output=True, text=True, timeout=60
    )
    assert [x["status"] for x in json.loads(runs.stdout)] == ["completed"]


def test_a_bad_launcher_variable_is_named(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {**os.environ, "HINDSIGHT_HOME": str(tmp_path / ".hindsight"), "RANK": "2", "WORLD_SIZE": "2"}
    r = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "RANK=2 is not a rank of WORLD_SIZE=2" in r.stderr, r.stderr

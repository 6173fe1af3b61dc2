"""A first recording explains itself: one line when it starts (the run, its
home, what its checkpoints hold and when they are taken), one per checkpoint
decision when asked ($HINDSIGHT_VERBOSE=1), one when it ends (checkpoints,
bytes, their cost, how to replay), and none with $HINDSIGHT_QUIET=1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import torch, hindsight as hs
torch.manual_seed(0)
m = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
with hs.checkpointing(model=m, optimizer=opt):
    for epoch in hs.loop("epoch", range(3)):
        for step in hs.loop("step", range(4)):
            opt.zero_grad()
            m(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
"""


def _record(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, "train.py"],
        cwd=tmp_path,
        env={**os.environ, "HINDSIGHT_HOME": str(tmp_path / ".hindsight"), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_recording_says_what_it_does_and_what_it_cost(tmp_path: Path) -> None:
    r = _record(tmp_path, HINDSIGHT_CHECKPOINT_EVERY="2", HINDSIGHT_VERBOSE="1")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("hindsight: ")]
    start, *decisions, end = lines
    run = re.match(r"hindsight: recording run (\S+) of train.py in (\S+); (.*)", start)
    assert run, start
    assert run[2] == str(tmp_path / ".hindsight")
    assert run[3] == (
        "checkpoints of model, optimizer, RNG states, loop variables (hindsight record --explain train.py); "
        "every 2 iterations of the outer loop; kept within 16.0 GiB (HINDSIGHT_CHECKPOINT_BUDGET), spread over the run"
    )
    assert decisions == [
        "hindsight: epoch 0: checkpoint (every 2)",
        "hindsight: epoch 1: no checkpoint (every 2)",
        "hindsight: epoch 2: checkpoint (every 2)",
    ]
    # Epochs 0 and 2 (the loop's end), with the bytes the saves wrote.
    done = re.fullmatch(
        rf"hindsight: run {run[1]} completed after [\d.]+ s: 2 checkpoints \(([\d.]+) (KiB|B)\ written\), "
        r"[\d.]+ m?s of training time in them \([\d.]+%\); the recording's own CPU was ([\d.]+)% of the "
        r"compute \(start-up ([\d.]+)%, checkpoints ([\d.]+)%, loop hooks ([\d.]+)%\)"
        r"(?:, [\d.]+% of it on cores the training left idle)?\. Add hs.log\(\.\.\.\) lines and replay: "
        r"hindsight replay train.py",
        end,
    )
    assert done, end
    # Its own account adds up: everything it cost is its start-up (hindsight's
    # import and the session's set-up: some, on any machine), its saves and
    # its hooks.
    total, startup, saves, hooks = (float(done[k]) for k in (3, 4, 5, 6))
    assert startup > 0, end
    assert abs(total - startup - saves - hooks) <= 0.2, end
    # The model and its optimizer state: 64x64+64 floats at least once.
    assert float(done[1]) * (1024 if done[2] == "KiB" else 1) >= (64 * 64 + 64) * 4


def test_quiet_prints_nothing_and_decisions_are_said_only_when_asked(tmp_path: Path) -> None:
    r = _record(tmp_path, HINDSIGHT_QUIET="1")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    r = _record(tmp_path, HINDSIGHT_RESUME="0")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and "adaptive: taken while the recording costs under" in lines[0], lines
    assert "completed after" in lines[1]

"""An outer iteration's start state is kept only where a checkpoint inside
it may need it (core `start_unkept`): in the first iteration a process
runs, and in every one after an iteration ran steps. An iteration that runs
steps without it takes no checkpoint inside; a stop signal there exits 85
and the resume runs it again from the last checkpoint, to the values of an
uninterrupted run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import os, signal, torch, hindsight as hs
torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
data = torch.randn(8, 4)
count = 0
with hs.checkpointing(model=net, optimizer=opt):
    for epoch in hs.loop("epoch", range(4)):
        count += 1  # code before the steps: a resume must not run it twice
        if epoch == 0:
            continue  # a warm-up iteration without steps
        for step in hs.loop("step", range(4)):
            loss = net(data[step * 2:(step + 1) * 2]).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            if os.environ.get("STOP") == f"{epoch}:{step}" and not os.path.exists("stopped"):
                open("stopped", "w").close()
                os.kill(os.getpid(), signal.SIGTERM)
print("result", count, repr(net.weight.tolist()), repr(opt.state_dict()["state"][0]["momentum_buffer"]))
"""


def _run(d: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("HINDSIGHT_")}
    return subprocess.run(
        [sys.executable, "t.py"],
        cwd=d,
        env={**base, "HINDSIGHT_CHECKPOINT_EVERY": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _result(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, r.stderr[-2000:]
    return next(line for line in r.stdout.splitlines() if line.startswith("result"))


@pytest.mark.parametrize("stop", ["1:1", "2:2"])
def test_a_signal_in_an_iteration_whose_start_was_not_kept_resumes_exactly(tmp_path: Path, stop: str) -> None:
    script = SCRIPT
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "t.py").write_text(script)
    want = _result(_run(plain))
    d = tmp_path / "stopped"
    d.mkdir()
    (d / "t.py").write_text(script)
    first = _run(d, STOP=stop)
    assert first.returncode == 85, first.stderr[-2000:]
    assert "result" not in first.stdout
    # The stop line says what happened: iteration 1's start was not kept (the
    # fallback), so nothing was checkpointed inside it; iteration 2's was.
    unkept = "no checkpoint inside this iteration" in first.stderr
    assert unkept == (stop == "1:1"), first.stderr[-2000:]
    assert ("checkpointed run" in first.stderr) == (stop != "1:1"), first.stderr[-2000:]
    again = _run(d)
    assert "resuming run" in again.stderr
    assert _result(again) == want


def test_a_run_another_process_holds_is_not_resumed_twice(tmp_path: Path) -> None:
    """Two launches that both find one interrupted run: the one that comes
    second is refused in one line naming the holder, and resumes nothing
    (issue 42, item 7). The first holder is this test, between the two."""
    from hindsight import _native

    (tmp_path / "t.py").write_text(SCRIPT)
    first = _run(tmp_path, STOP="2:1")
    assert first.returncode == 85, first.stderr[-2000:]
    home = tmp_path / ".hindsight"
    run_id = _native.LogDb(str(home / "logs.db")).runs()[0].id
    held = _native.RunLease.hold(str(home), run_id)
    second = _run(tmp_path)
    assert second.returncode == 2, second.stderr[-2000:]
    assert "result" not in second.stdout
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pid {os.getpid()} on host" in lines[0] and run_id in lines[0], second.stderr
    held.release()
    third = _run(tmp_path)
    assert "resuming run" in third.stderr and _result(third).startswith("result 4 ")

"""`hindsight run`: a crashed or hung training command is restarted and
resumes from its last checkpoint, bit-identical to an uninterrupted run;
crash loops stop; signals pass through. Real processes throughout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import hindsight_cmd

TRAIN = """
import os, sys, time
import torch
from torch import nn
import hindsight as hs

out = hs.arg("out", "")
fault = os.environ.get("FAULT", "")  # "crash@N" or "hang@N": on the first attempt only
first_attempt = "HINDSIGHT_RESTART" not in os.environ
kind, _, at = fault.partition("@")
torch.manual_seed(0)
g = torch.Generator().manual_seed(7)
x_all = torch.randn(256, 8, generator=g)
y_all = (x_all.sum(dim=1) > 0).long()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_all, y_all), batch_size=32, shuffle=True)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
k = 0
with hs.checkpointing(model=net, optimizer=opt, every=1):
    for epoch in hs.loop("epoch", range(4)):
        for x, y in hs.loop("step", loader):
            k += 1
            if first_attempt and kind and k == int(at):
                if kind == "crash":
                    raise RuntimeError("injected crash")
                time.sleep(3600)  # injected hang
            loss = nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            hs.log("loss", loss.item())
            print("step", flush=True)
if out:
    torch.save(net.state_dict(), out)
"""


def supervised(
    tmp: Path, *options: str, fault: str = "", timeout: float = 240
) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp / "train.py"
    script.write_text(TRAIN)
    out = tmp / "final.pt"
    env = {**os.environ, "HINDSIGHT_HOME": str(tmp / "home"), "FAULT": fault}
    r = subprocess.run(
        [*hindsight_cmd(), "run", *options, "--", sys.executable, str(script), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp,
    )
    return r, out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    d = tmp_path_factory.mktemp("ref")
    r, out = supervised(d)
    assert r.returncode == 0, r.stderr
    return torch.load(out)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("at", [5, 19])
def test_a_crash_is_restarted_and_resumes_exactly(tmp_path: Path, reference: dict[str, torch.Tensor], at: int) -> None:
    r, out = supervised(tmp_path, "--backoff", "0.1", fault=f"crash@{at}")
    assert r.returncode == 0, r.stderr
    assert "injected crash" in r.stderr and "restart 1 of 3" in r.stderr
    assert "resuming run" in r.stderr
    assert same(torch.load(out), reference)


def test_a_hang_is_detected_dumped_killed_and_resumed(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    # Generous for a loaded CI machine: a restarted process imports torch's
    # compiler stack at its first optimizer step.
    r, out = supervised(tmp_path, "--hang-timeout", "15", "--backoff", "0.1", fault="hang@11")
    assert r.returncode == 0, r.stderr
    assert "no step boundary for 15 s" in r.stderr
    # The Python stacks of every thread of the hung process, naming where it sleeps.
    dump = r.stderr.split("no step boundary")[1]
    assert "most recent call first" in dump and "train.py" in dump
    assert "hung and was killed" in r.stderr
    assert same(torch.load(out), reference)


def test_a_crash_loop_stops_after_max_restarts(tmp_path: Path) -> None:
    script = tmp_path / "always_fails.py"
    script.write_text("import sys\nprint('attempt', flush=True)\nsys.exit(7)\n")
    t0 = time.monotonic()
    r = subprocess.run(
        [*hindsight_cmd(), "run", "--max-restarts", "2", "--backoff", "0.1", "--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 7
    assert r.stdout.count("attempt") == 3  # the first start and two restarts
    assert "giving up after 2 restart(s)" in r.stderr
    assert "in 0.1 s" in r.stderr and "in 0.2 s" in r.stderr  # backing off
    assert time.monotonic() - t0 < 60


def test_a_signal_passes_through_and_the_checkpoint_exit_code_comes_back(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN.replace('print("step", flush=True)', 'print("step", flush=True); time.sleep(0.05)'))
    env = {**os.environ, "HINDSIGHT_HOME": str(tmp_path / "home")}
    p = subprocess.Popen(
        [*hindsight_cmd(), "run", "--", sys.executable, str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    assert p.stdout is not None
    for _ in range(5):
        assert p.stdout.readline().startswith("step")
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 85, err  # for the batch system: checkpointed, reschedule me
    assert "checkpointed run" in err
    assert "restart" not in err

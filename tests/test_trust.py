"""A resume or a replay proves itself or fails loudly: the script shapes that
used to give wrong values with exit 0, and the checks (batch fingerprints,
recorded values as the oracle) that now catch a wrong one, each shown to
fire by breaking the data or its order on purpose."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import hindsight_cmd

# A GAN-like loop over `enumerate(loader)` (the iterator, and with workers
# its shuffle order, is created before hs.loop sees it), two models, two
# optimizers. The loader's data is read from data.pt, so a test can change
# it between record and replay.
GAN = """
import argparse, sys, time
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset
import hindsight as hs

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--workers", type=int, default=2)
p.add_argument("--out", default="final.pt")
p.add_argument("--delay", type=float, default=0.0)
p.add_argument("--order", default="global")
p.add_argument("--count", default="inside")  # or outside: enumerate(hs.loop(...))
args = hs.args(p)
torch.manual_seed(0)
x, y = torch.load("data.pt")
ds = TensorDataset(x, y)
gen, disc = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.Linear(8, 1))
og = torch.optim.Adam(gen.parameters(), lr=1e-2)
od = torch.optim.Adam(disc.parameters(), lr=1e-2)
with hs.checkpointing(gen=gen, disc=disc, og=og, od=od):
    for epoch in hs.loop("epoch", range(args.epochs)):
        if args.order == "global":
            loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=args.workers)
        else:  # an order drawn from outside any generator hindsight checkpoints
            import os
            g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
            loader = DataLoader(ds, batch_size=8, sampler=RandomSampler(ds, generator=g), num_workers=args.workers)
        steps = hs.loop("step", enumerate(loader)) if args.count == "inside" else enumerate(hs.loop("step", loader))
        for i, (xb, yb) in steps:
            fake = gen(xb + 0.1 * torch.randn_like(xb))
            ld = nn.functional.softplus(-disc(xb)).mean() + nn.functional.softplus(disc(fake.detach())).mean()
            od.zero_grad(); ld.backward(); od.step()
            lg = nn.functional.softplus(-disc(fake)).mean()
            og.zero_grad(); lg.backward(); og.step()
            hs.log("ld", ld.item())
            hs.log("lg", lg.item())
            hs.log("i", i)
            print("step", epoch, i, flush=True)
            time.sleep(args.delay)
        hs.log("gnorm", sum(p.norm().item() for p in gen.parameters()))  # PROBE
torch.save({**{"g." + k: v for k, v in gen.state_dict().items()}, **{"d." + k: v for k, v in disc.state_dict().items()}}, args.out)
"""
BATCHES = 6  # 48 examples in batches of 8
EPOCHS = 3


def project(root: Path, script: str = GAN) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.py").write_text(script)
    g = torch.Generator().manual_seed(1)
    torch.save((torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)), root / "data.pt")
    return root / "train.py"


def env(root: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "HINDSIGHT_HOME": str(root / ".hindsight"), **extra}


def run(root: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=root,
        env=env(root, **extra),
        capture_output=True,
        text=True,
        timeout=300,
    )


def series(root: Path) -> dict[str, dict[str, object]]:
    code = (
        "import json, os\nfrom hindsight import _native\n"
        "db = _native.LogDb(os.path.join(os.environ['HINDSIGHT_HOME'], 'logs.db'))\n"
        "runs = db.runs()\nassert len(runs) == 1, [r.id for r in runs]\nout = {}\n"
        "for v in db.values(runs[0].id):\n"
        "    out.setdefault(v.name, {})[json.dumps([v.ctx, v.rep])] = json.loads(v.value_json)\n"
        "print(json.dumps({'status': runs[0].status, 'logs': out}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env(root), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def interrupt(root: Path, sig: int, at: int, *args: str) -> subprocess.CompletedProcess[str]:
    """Run until the step numbered `at` (0-based over the run) has printed,
    send `sig`. The rerun that resumes must pass the same `args`."""
    p = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=root,
        env=env(root),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    seen = 0
    while seen <= at:
        line = p.stdout.readline()
        assert line, p.stderr.read() if p.stderr else ""
        seen += line.startswith("step ")
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict]:
    root = tmp_path_factory.mktemp("ref")
    project(root)
    r = run(root, "--out", "final.pt")
    assert r.returncode == 0, r.stderr
    return torch.load(root / "final.pt"), series(root)


# The boundaries a random step hides: the first step, mid-epoch, the last
# step of an epoch, the last step of the run.
@pytest.mark.parametrize(
    ("sig", "at"),
    [
        (signal.SIGUSR1, 0),
        (signal.SIGTERM, BATCHES + 2),
        (signal.SIGUSR1, BATCHES - 1),
        (signal.SIGTERM, EPOCHS * BATCHES - 1),
    ],
    ids=["first-step", "mid-epoch", "epoch-last-step", "run-last-step"],
)
def test_enumerate_of_a_shuffling_loader_with_workers_resumes_exactly(tmp_path, reference, sig, at):
    check_resume(tmp_path, reference, sig, at, "inside")


@pytest.mark.parametrize("at", [BATCHES + 2, 2 * BATCHES - 1], ids=["mid-epoch", "epoch-last-step"])
def test_an_enumerate_around_the_step_loop_counts_on_from_the_resumed_step(tmp_path, reference, at):
    """`for i, b in enumerate(hs.loop("step", loader))`: the steps done before
    the signal are skipped, and the script's own `i` must go on from there
    (it used to restart at 0: values logged with the wrong index)."""
    check_resume(tmp_path, reference, signal.SIGTERM, at, "outside")


def check_resume(
    tmp_path: Path, reference: tuple[dict[str, torch.Tensor], dict], sig: int, at: int, count: str
) -> None:
    ref_weights, ref_series = reference
    project(tmp_path)
    args = ("--out", "final.pt", "--delay", "0.05", "--count", count)
    r = interrupt(tmp_path, sig, at, *args)
    assert r.returncode == 85, r.stderr
    r = run(tmp_path, *args)
    assert r.returncode == 0, r.stderr
    assert "resuming run" in r.stderr
    weights = torch.load(tmp_path / "final.pt")
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights), f"weights differ (signal at {at})"
    got = series(tmp_path)
    assert got["status"] == "completed"
    assert got["logs"] == ref_series["logs"], f"logged values differ (signal at {at})"


@pytest.mark.parametrize(
    "loading",
    [
        ("--workers", "2"),
        # No workers, the loader given to hs.loop: the resume steps over the
        # consumed batches by their sampler indices alone, loading nothing
        # (that used to go unchecked, and trained on other data, exit 0).
        ("--workers", "0", "--count", "outside"),
    ],
    ids=["loaded", "indices"],
)
def test_a_resume_whose_data_order_cannot_be_restored_stops_naming_the_step(tmp_path, loading):
    """The sampler draws its order from a generator seeded by os.urandom:
    no checkpoint can restore it. The resume must not go on with other data."""
    project(tmp_path)
    args = ("--order", "urandom", "--delay", "0.05", *loading)
    r = interrupt(tmp_path, signal.SIGUSR1, BATCHES + 3, *args)
    assert r.returncode == 85, r.stderr
    r = run(tmp_path, *args)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "DivergenceError" in r.stderr
    assert "the batch at epoch 1, step 0 differs from the recorded one" in r.stderr, r.stderr
    assert series(tmp_path)["status"] == "interrupted"  # left to resume once the order is restored


def replay(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*hindsight_cmd(), "replay", "train.py", "-q", *extra],
        cwd=root,
        env=env(root),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_replay_on_data_that_changed_on_disk_stops_at_the_first_batch_that_differs(tmp_path):
    project(tmp_path)
    r = run(tmp_path, HINDSIGHT_CHECKPOINT_EVERY="1")
    assert r.returncode == 0, r.stderr
    src = (tmp_path / "train.py").read_text()
    (tmp_path / "train.py").write_text(
        src.replace('hs.log("lg", lg.item())', 'hs.log("lg", lg.item())\n            hs.log("dnorm", xb.norm().item())')
    )
    x, y = torch.load(tmp_path / "data.pt")
    x[::2] += 1.0  # the file the script reads changed since the recording
    torch.save((x, y), tmp_path / "data.pt")
    r = replay(tmp_path)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "differs from the one the recording consumed" in r.stderr, r.stderr
    assert "epoch 0, step 0" in r.stderr or "epoch 1, step 0" in r.stderr, r.stderr
    # Nothing it computed is presented as a result.
    out = subprocess.run(
        [*hindsight_cmd(), "--home", str(tmp_path / ".hindsight"), "logs", "dnorm"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 or "dnorm" not in out.stdout.split("\n", 1)[-1], out.stdout


# nanoGPT's shape: an iteration loop over itertools.count(), the learning
# rate warmed up from the counter, gradients accumulated over micro-steps
# (the inner loop) and applied after it, the next batch prefetched, one
# torch thread set by the script.
ITER = """
import itertools, math
import torch
from torch import nn
import hindsight as hs

torch.set_num_threads(1)
torch.manual_seed(0)
data = torch.randn(4096, 9)
model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
def get_batch():
    ix = torch.randint(0, data.shape[0], (16,))
    return data[ix, :8], data[ix, 8:]
X, Y = get_batch()
iter_num = 0
with hs.checkpointing(model=model, opt=opt, every=3):
    for it in hs.loop("iter", itertools.count()):
        lr = 1e-2 * min(1.0, (iter_num + 1) / 5) * 0.5 * (1 + math.cos(math.pi * iter_num / 30))
        for g in opt.param_groups:
            g["lr"] = lr
        for micro in hs.loop("micro", range(3)):
            loss = nn.functional.mse_loss(model(X), Y) / 3
            X, Y = get_batch()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        hs.log("loss", loss.item() * 3)
        # PROBE
        iter_num += 1
        if iter_num >= 24:
            break
torch.save(model.state_dict(), "final.pt")
"""
ITER_PROBE = ("        # PROBE\n", '        hs.log("wnorm", sum(p.norm().item() for p in model.parameters()))\n')


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_an_iteration_loop_with_accumulation_replays_exactly(tmp_path, jobs):
    ref = tmp_path / "ref"
    project(ref, ITER.replace(*ITER_PROBE))
    assert run(ref).returncode == 0
    want = series(ref)["logs"]["wnorm"]
    rec = tmp_path / "rec"
    project(rec, ITER)
    r = run(rec)
    assert r.returncode == 0, r.stderr
    (rec / "train.py").write_text(ITER.replace(*ITER_PROBE))
    r = replay(rec, "-j", jobs)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DIVERGENCE" not in r.stderr
    assert series(rec)["logs"]["wnorm"] == want


# time_sequence_prediction's shape: one loop level, each iteration one
# optimizer step, and code after the loop that reads the trained model.
ONE_LEVEL = """
import time
import torch
from torch import nn
import hindsight as hs

torch.manual_seed(0)
x, y = torch.load("data.pt")
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with hs.checkpointing(model=model, opt=opt):
    for step in hs.loop("step", range(6)):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        hs.log("loss", loss.item())
        print("step", step, flush=True)
        time.sleep(0.05)
torch.save(model.state_dict(), "final.pt")
"""


@pytest.mark.parametrize("at", [2, 5], ids=["middle", "last-iteration"])
def test_a_one_level_loop_signalled_in_any_iteration_resumes_to_the_same_weights(tmp_path, at):
    """A signal in the last iteration used to resume with the initial
    weights: every iteration was skipped and nothing restored the state
    the code after the loop reads."""
    ref = tmp_path / "ref"
    project(ref, ONE_LEVEL)
    assert run(ref).returncode == 0
    rec = tmp_path / "rec"
    project(rec, ONE_LEVEL)
    r = interrupt(rec, signal.SIGTERM, at)
    assert r.returncode == 85, r.stderr
    r = run(rec)
    assert r.returncode == 0, r.stderr
    want, got = torch.load(ref / "final.pt"), torch.load(rec / "final.pt")
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert series(rec)["logs"] == series(ref)["logs"]


# A state change the recording did not make and no logged value shows: the
# replay's own state check (its state against each checkpoint it reaches by
# executing) is what catches it. `t0` is a clock reading kept in a loop
# variable: it differs on every run and must not fail a replay.
DRIFT = """
import os, time
import torch
import hindsight as hs

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.randn(32, 4)
with hs.checkpointing(model=model, opt=opt):
    for epoch in hs.loop("epoch", range(3)):
        t0 = time.time()
        for i in hs.loop("step", range(4)):
            loss = model(data[i * 8 : (i + 1) * 8]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if epoch == 1 and i == 3 and os.environ.get("DRIFT"):
                with torch.no_grad():
                    model.bias.add_(1e-3)
        hs.log("epoch_done", epoch)
"""


def test_a_replay_whose_state_drifts_from_a_checkpoint_stops_naming_the_tensor(tmp_path):
    (tmp_path / "train.py").write_text(DRIFT)
    r = run(tmp_path, HINDSIGHT_CHECKPOINT_EVERY="1")
    assert r.returncode == 0, r.stderr
    src = (tmp_path / "train.py").read_text()
    (tmp_path / "train.py").write_text(
        src.replace("opt.step()\n", 'opt.step()\n            hs.log("loss", loss.item())\n')
    )
    # As recorded: every executed epoch proves its state; the clock reading is a note.
    r = replay(tmp_path, "-j", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "vars/" in r.stderr and "clock reading" in r.stderr, r.stderr
    # Drifted: the first checkpoint after the drift stops the replay, naming the tensor.
    r = subprocess.run(
        [*hindsight_cmd(), "replay", "train.py", "-q", "-j", "1", "--force"],
        cwd=tmp_path,
        env=env(tmp_path, DRIFT="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 3, r.stdout + r.stderr
    assert "after epoch 1, the state differs from the recorded checkpoint" in r.stderr, r.stderr
    assert "'objects/model/bias'" in r.stderr, r.stderr

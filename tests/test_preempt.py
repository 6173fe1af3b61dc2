"""Preemption-proof training with real processes and signals."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import hindsight as hs

from conftest import REPO, hindsight_cmd, run_py

SCRIPT = REPO / "examples" / "preemptible_train.py"
TOTAL_STEPS = 4 * 20  # 4 epochs of 20 batches


def start(home: Path, out: Path, delay: float = 0.02, **env: str) -> subprocess.Popen[str]:
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--delay", str(delay), "--out", str(out)],
        env={**os.environ, "HINDSIGHT_HOME": str(home), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=out.parent,
    )


def run_to_end(home: Path, out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--delay", "0.02", "--out", str(out)],
        env={**os.environ, "HINDSIGHT_HOME": str(home), **env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=out.parent,
    )


def series(home: Path) -> dict[str, dict[str, object]]:
    """Every logged value of the (single) run: {name: {ctx: value}}."""
    code = (
        "import json, os\nfrom hindsight import _native\n"
        "db = _native.LogDb(os.path.join(os.environ['HINDSIGHT_HOME'], 'logs.db'))\n"
        "runs = db.runs()\nassert len(runs) == 1, [r.id for r in runs]\n"
        "out = {}\n"
        "for rec in db.logs(runs[0].id):\n"
        "    out.setdefault(rec.name, {})[json.dumps(rec.ctx)] = json.loads(rec.value_json)\n"
        "print(json.dumps({'status': runs[0].status, 'logs': out}))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "HINDSIGHT_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def uninterrupted(d: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The final weights and logged series of a run never interrupted."""
    r = run_to_end(d / "home", d / "final.pt")
    assert r.returncode == 0, r.stderr
    return torch.load(d / "final.pt"), series(d / "home")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict]:
    return uninterrupted(tmp_path_factory.mktemp("ref"))


def interrupt_and_resume(
    tmp: Path, sig: int, at_step: int, env: dict[str, str] | None = None, resume_env: dict[str, str] | None = None
) -> tuple[dict[str, torch.Tensor], dict, str]:
    home, out = tmp / "home", tmp / "final.pt"
    env = env or {}
    p = start(home, out, **env)
    assert p.stdout is not None
    seen = 0
    while seen < at_step:
        line = p.stdout.readline()
        assert line, p.stderr.read() if p.stderr else ""
        seen += line.startswith("step ")
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 85, err
    assert "checkpointed run" in err
    assert not out.exists()
    r = run_to_end(home, out, **(env if resume_env is None else resume_env))
    assert r.returncode == 0, r.stderr
    assert "resuming run" in r.stderr
    return torch.load(out), series(home), r.stdout


# SIGUSR1 takes SIGTERM's path (CI: test_loopstate's SIGUSR1 case, test_slurm's scancel).
@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, pytest.param(signal.SIGUSR1, marks=pytest.mark.matrix)], ids=["SIGTERM", "SIGUSR1"]
)
def test_signal_checkpoint_exit_85_and_exact_resume(tmp_path, reference, sig):
    ref_weights, ref_series = reference
    rng = random.Random(sig)
    for trial in range(2):
        at = rng.randrange(3, TOTAL_STEPS - 5)
        weights, got, stdout = interrupt_and_resume(tmp_path / f"t{trial}", sig, at)
        assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights), f"weights differ (signal at {at})"
        assert got["status"] == "completed"
        # Same contexts, same values: nothing duplicated, nothing missing, same data order.
        assert got["logs"] == ref_series["logs"], f"log series differ (signal at {at})"
        # The resumed process did not redo the steps finished before the signal.
        assert stdout.count("step ") <= TOTAL_STEPS - at + 1


def test_a_moved_project_resumes_its_interrupted_run(tmp_path, reference):
    """The resume key takes the script relative to the project root: a
    project moved after a preemption (another scratch directory, a renamed
    checkout) resumes its run from its own store, exactly."""
    proj = tmp_path / "proj"
    proj.mkdir()
    shutil.copy(SCRIPT, proj / "train.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HINDSIGHT_")}  # home: proj/.hindsight
    cmd = [sys.executable, "train.py", "--delay", "0.02", "--out", "final.pt"]
    p = subprocess.Popen(cmd, cwd=proj, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    seen = 0
    while seen < 30:
        line = p.stdout.readline()
        assert line, p.stderr.read() if p.stderr else ""
        seen += line.startswith("step ")
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 85, err
    moved = tmp_path / "moved"
    proj.rename(moved)
    r = subprocess.run(cmd, cwd=moved, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "resuming run" in r.stderr, r.stderr
    ref_weights, ref_series = reference
    weights = torch.load(moved / "final.pt")
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    got = series(moved / ".hindsight")
    assert got["status"] == "completed"
    assert got["logs"] == ref_series["logs"]


def test_kill_9_resumes_from_newest_complete_checkpoint(tmp_path, reference):
    ref_weights, ref_series = reference
    rng = random.Random(9)
    home, out = tmp_path / "home", tmp_path / "final.pt"
    # Safety checkpoints every ~0.3 s of training make kills land during writes too.
    env = {"HINDSIGHT_SAFETY_MINUTES": "0.005"}
    for _ in range(3):
        p = start(home, out, **env)
        assert p.stdout is not None
        for _ in range(rng.randrange(2, 25)):
            if not p.stdout.readline():
                break
        time.sleep(rng.uniform(0, 0.1))
        p.kill()
        p.communicate(timeout=60)
        if out.exists():
            break
    r = run_to_end(home, out, **env)
    assert r.returncode == 0, r.stderr
    weights = torch.load(out)
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    assert series(home)["logs"] == ref_series["logs"]
    v = subprocess.run([*hindsight_cmd(), "verify", str(home / "store")], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout


RETENTION_SCRIPT = """
import torch, hindsight as hs
net = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
val = [5.0, 1.0, 4.0, 3.0, 2.5, 6.0]
with hs.checkpointing(model=net, optimizer=opt, every=1, keep_last=2, keep_best=1, best_metric="val_loss"):
    for epoch in hs.loop("epoch", range(len(val))):
        for _ in hs.loop("step", range(3)):
            net.weight.data.add_(1.0)
        hs.log("val_loss", val[epoch])
"""


def test_retention_keep_last_2_and_best_1(tmp_path):
    script = tmp_path / "ret.py"
    script.write_text(RETENTION_SCRIPT)
    home = tmp_path / "home"
    r = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "HINDSIGHT_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    ls = subprocess.run([*hindsight_cmd(), "ls", "--json", str(home / "store")], capture_output=True, text=True)
    names = sorted(c["name"].rsplit("-", 1)[1] for c in json.loads(ls.stdout))
    assert names == ["000001", "000004", "000005"]  # best (epoch 1) + last two
    v = subprocess.run([*hindsight_cmd(), "verify", str(home / "store")], capture_output=True, text=True)
    assert v.returncode == 0 and "3 checkpoints" in v.stdout, v.stdout
    du = subprocess.run([*hindsight_cmd(), "du", "--json", str(home / "store")], capture_output=True, text=True)
    assert json.loads(du.stdout)["unreferenced_chunks"] == 0  # deleted checkpoints' chunks were collected


def test_htcondor_exit_code_from_job_ad(tmp_path, reference):
    ad = tmp_path / ".job.ad"
    ad.write_text('MyType = "Job"\nCheckpointExitCode = 77\n')
    p = start(tmp_path / "home", tmp_path / "final.pt", _CONDOR_JOB_AD=str(ad))
    assert p.stdout is not None
    for _ in range(5):
        p.stdout.readline()
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=120)
    assert p.returncode == 77


def checkpoint_epochs(store: hs.Store) -> list[str]:
    return sorted(n.rsplit("-", 1)[1] for n in store.list())


def expected_retained(logs: dict) -> list[str]:
    """keep_last=2 + keep_best=1 by val_loss (min) of the example's 4 epochs."""
    val = {json.loads(ctx)[0][1]: v for ctx, v in logs["val_loss"].items()}
    best = min(val, key=lambda e: val[e])
    return sorted({f"{e:06d}" for e in (best, 2, 3)})


def test_preemption_resume_and_retention_on_object_storage(tmp_path, reference, object_url):
    """The run's checkpoints live in the object store only (S3, Azure): SIGTERM
    -> 85 -> resume from it -> bit-identical; retention leaves exactly the
    expected checkpoints there."""
    ref_weights, ref_series = reference
    url = object_url
    at = random.Random(3).randrange(25, TOTAL_STEPS - 5)
    weights, got, _ = interrupt_and_resume(tmp_path, signal.SIGTERM, at, env={"HINDSIGHT_STORE": url})
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    assert got["logs"] == ref_series["logs"]
    assert not (tmp_path / "home" / "store").exists()  # nothing went to the local default
    with hs.Store(url, create=False) as store:
        assert checkpoint_epochs(store) == expected_retained(got["logs"])
        assert store.verify() == []
        assert store.usage()["unreferenced_chunks"] == 0
    # The CLI of the package reads the same store.
    ls = subprocess.run([*hindsight_cmd(), "ls", "--json", url], capture_output=True, text=True, timeout=60)
    assert ls.returncode == 0, ls.stderr
    assert sorted(c["name"].rsplit("-", 1)[1] for c in json.loads(ls.stdout)) == expected_retained(got["logs"])
    # Replay of the script with a new epoch-level log statement restores the
    # checkpoints from S3 (the run remembers its store) and recomputes the rest.
    probe = tmp_path / "probe.py"
    probe.write_text(
        SCRIPT.read_text().replace(
            "        sched.step()\n",
            '        sched.step()\n        hs.log("weight_norm", sum(p.detach().norm().item() for p in net.parameters()))\n',
        )
    )
    from hindsight import _native

    run_id = _native.LogDb(str(tmp_path / "home" / "logs.db")).runs()[0].id
    (tmp_path / "final.pt").unlink()
    rp = subprocess.run(
        [*hindsight_cmd(), "replay", str(probe), "--run", run_id, "-q", "--strict"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "HINDSIGHT_HOME": str(tmp_path / "home")},
    )
    assert rp.returncode == 0, rp.stdout + rp.stderr
    assert "restored from" in rp.stdout, rp.stdout
    after = series(tmp_path / "home")["logs"]
    assert len(after["weight_norm"]) == 4 and after["val_loss"] == got["logs"]["val_loss"]
    replayed = torch.load(tmp_path / "final.pt")
    assert all(torch.equal(replayed[k], ref_weights[k]) for k in ref_weights)


def test_local_first_exit_waits_for_upload_and_resumes_on_another_node(tmp_path, reference, object_url):
    """SIGUSR1 with a local-first store: at exit 85 the step checkpoint is already
    in the object store (S3, Azure); the rerun on a 'node' without the local
    copy resumes from there exactly."""
    ref_weights, ref_series = reference
    url = object_url
    home, out = tmp_path / "home", tmp_path / "final.pt"
    p = start(home, out, HINDSIGHT_STORE=url, HINDSIGHT_LOCAL_FIRST=str(tmp_path / "node1"))
    assert p.stdout is not None
    for _ in range(random.Random(4).randrange(25, TOTAL_STEPS - 5)):
        assert p.stdout.readline()
    p.send_signal(signal.SIGUSR1)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 85, err
    with hs.Store(url, create=False) as store:
        step = [n for n in store.list() if ".step-" in n]
        assert len(step) == 1, store.list()
        assert store.verify() == []
    shutil.rmtree(tmp_path / "node1")
    r = run_to_end(home, out, HINDSIGHT_STORE=url, HINDSIGHT_LOCAL_FIRST=str(tmp_path / "node2"))
    assert r.returncode == 0, r.stderr
    assert f"continues from checkpoint {step[0]}" in r.stderr
    weights = torch.load(out)
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    got = series(home)
    assert got["logs"] == ref_series["logs"]
    with hs.Store(url, create=False) as store:
        assert checkpoint_epochs(store) == expected_retained(got["logs"])
        assert store.verify() == []


def test_sigusr1_after_the_loop_is_noted_not_fatal(tmp_path):
    """A batch system's time warning (`--signal=B:USR1@90`) landing after
    training, in the final save or while the run's checkpoints are flushed at
    exit, must not kill the process (it did, on the Slurm cluster): it is
    noted, and a training loop started later honours it. Also in Python's
    finalization, which puts the default (fatal) action back."""
    code = """
import os, signal, sys
import torch
import hindsight as hs
from hindsight import _preemption
w = torch.zeros(2)
with hs.checkpointing(w=w, every=1):
    for epoch in hs.loop("epoch", range(2)):
        for step in hs.loop("step", range(2)):
            w += 1
os.kill(os.getpid(), signal.SIGUSR1)  # after the loop, before the final save
torch.save(w, sys.argv[1])
# What the run's exit puts back (the window in which the cluster's signal came):
signal.getsignal(signal.SIGUSR1).__self__.restore()
os.kill(os.getpid(), signal.SIGUSR1)
later = _preemption.StopSignals(False)
later.install()
print("later loop sees", later.received, flush=True)
later.restore()

class Last:  # collected in interpreter finalization, after the atexit hooks
    def __del__(self):
        os.kill(os.getpid(), signal.SIGUSR1)
        import time; time.sleep(0.2)
last = Last()
"""
    final = tmp_path / "final.pt"
    r = run_py(code, str(final), env={"HINDSIGHT_HOME": str(tmp_path / "home")})
    assert r.returncode == 0, r.stderr
    assert torch.equal(torch.load(final), torch.full((2,), 4.0))
    assert "SIGUSR1 after the training loop ended" in r.stderr
    assert f"later loop sees {int(signal.SIGUSR1)}" in r.stdout, r.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_before_any_run_exits_with_its_code_and_says_so(tmp_path, sig):
    """Issue 43: once hindsight is imported, a stop signal during the data
    loading or model build, before any run started, leaves with a word and
    the signal's conventional exit code (128 + N), not killed by it; a
    user's own handler stands. Under `python -m hindsight.torchrun` the
    launcher counts such ranks as stopped (exit 85)."""
    code = """
import os, signal, sys
import hindsight as hs
if sys.argv[1] == "own":
    signal.signal(signal.SIGTERM, lambda *a: (print("own handler", flush=True), sys.exit(7)))
    signal.signal(signal.SIGUSR1, lambda *a: (print("own handler", flush=True), sys.exit(7)))
os.kill(os.getpid(), int(sys.argv[2]))  # during "data loading"
print("not reached", flush=True)
"""
    r = run_py(code, "default", str(int(sig)), env={"HINDSIGHT_HOME": str(tmp_path / "home")})
    assert r.returncode == 128 + sig, (r.returncode, r.stderr)
    assert f"hindsight: {signal.Signals(sig).name} before this process started a run" in r.stderr, r.stderr
    assert "not reached" not in r.stdout and "Traceback" not in r.stderr
    assert not (tmp_path / "home").exists(), "no run was left behind"
    r = run_py(code, "own", str(int(sig)), env={"HINDSIGHT_HOME": str(tmp_path / "home")})
    assert r.returncode == 7 and "own handler" in r.stdout, (r.returncode, r.stdout, r.stderr)

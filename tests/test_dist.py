"""Checkpoints of real `torchrun` jobs (gloo, CPU) through `hindsight.dist`:
DDP and FSDP2 save one checkpoint per step from every rank, committed once;
it loads on another number of ranks (2→1, 2→4) with every weight equal, and
resumes on the same number bit-identically; a rank killed mid-save leaves
nothing listed. The worker is tests/dist_worker.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import hindsight as hs

from conftest import children, hindsight_cmd

# Several ranks per test on 2 cores: beside another test's load a rank aborted
# at exit (C++ terminate, exit -6), so these run alone; their launchers start
# afresh (a forked launcher failed in the serial phase; docs/testing.md).
pytestmark = [pytest.mark.serial, pytest.mark.fresh_process]

WORKER = Path(__file__).with_name("dist_worker.py")


def torchrun(
    n: int,
    mode: str,
    store: Path | str,
    out: Path,
    steps: int = 6,
    save_at: int = 3,
    wait: bool = True,
    launcher: str = "torch.distributed.run",
    restarts: int = 0,
) -> Any:
    """`torchrun --nproc_per_node=n dist_worker.py ...`: its result, or the
    running process when not ``wait``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        launcher,
        "--standalone",
        f"--nproc_per_node={n}",
        f"--max-restarts={restarts}",
        str(WORKER),
        mode,
        str(store),
        str(out),
        str(steps),
        str(save_at),
    ]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_checkpoint_of_two_ranks_is_one_checkpoint_that_loads_on_one_two_and_four(tmp_path: Path, kind: str) -> None:
    store = tmp_path / "store"
    r = torchrun(2, f"{kind}-train", store, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    s = hs.Store(store)
    # One checkpoint, not one per rank; no part is left listed or stored.
    assert s.list() == ["ck-3"]
    assert not [p for p in (store / "manifests").iterdir() if p.name != "ck-3.hsm"]
    assert s.info("ck-3")["meta"]["hs.world"] == "2"
    assert s.verify() == []
    saved = weights(tmp_path / "at-3.pt")
    resume = "ddp-resume" if kind == "ddp" else "fsdp-load"
    for n in (1, 4):
        r = torchrun(n, resume, store, tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        # What is compared on another world size: the weights right after the
        # load, gathered whole, against the weights the 2 ranks saved.
        assert_equal(weights(tmp_path / f"loaded-{resume}-{n}.pt"), saved)
        # Per-rank state (RNG, a DistributedSampler's place) is refused there.
        assert "was saved by 2 ranks and this job has" in (tmp_path / f"refused-{n}.txt").read_text()
    # On the same world size the run resumes exactly: optimizer state and
    # each rank's dropout stream included, the final weights are bit-identical.
    r = torchrun(2, resume, store, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_equal(weights(tmp_path / f"final-{resume}-2.pt"), weights(tmp_path / f"final-{kind}-train-2.pt"))
    # One process reads the whole model of a sharded checkpoint (export).
    from safetensors.torch import load_file

    done = hs.dist.consolidate(s, "ck-3", tmp_path / "model.safetensors", path="state/model")
    assert done["tensors"] == len(saved)
    assert_equal(load_file(tmp_path / "model.safetensors"), saved)
    # The same through the command line, from the whole checkpoint: plain
    # values (the step, the optimizer's hyperparameters) are named as left out.
    r = subprocess.run(
        [*hindsight_cmd(), "--store", str(store), "consolidate", "ck-3", str(tmp_path / "all.safetensors")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "values that are not tensors: state/optim/param_groups/0/" in r.stdout, r.stdout
    whole = load_file(tmp_path / "all.safetensors")
    assert_equal({k.removeprefix("state.model."): v for k, v in whole.items() if k.startswith("state.model.")}, saved)


def test_a_rank_killed_mid_save_leaves_no_checkpoint_listed(tmp_path: Path) -> None:
    store = tmp_path / "store"
    r = torchrun(2, "die-mid-save", store, tmp_path)
    assert r.returncode != 0
    s = hs.Store(store)
    assert s.list() == []
    assert s.verify() == []
    # The job run again completes and commits.
    r = torchrun(2, "fsdp-train", store, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert s.list() == ["ck-3"]


@pytest.mark.parametrize(
    ("sig", "to", "restarts"),
    [
        (signal.SIGTERM, "rank 1", 0),
        pytest.param(signal.SIGUSR1, "rank 1", 0, marks=pytest.mark.matrix),  # the same path as SIGTERM's
        (signal.SIGTERM, "torchrun", 0),
        (signal.SIGUSR1, "torchrun", 0),  # it used to kill the launcher (exit -10)
        # Every process of the job, as scancel, Slurm's --signal and HTCondor's eviction deliver it.
        (signal.SIGTERM, "the job", 0),
        pytest.param(signal.SIGUSR1, "the job", 0, marks=pytest.mark.matrix),
        # torchrun's own restarts: ranks that checkpointed to leave are not
        # restarted in place (they resumed and trained on until killed).
        (signal.SIGTERM, "rank 1", 2),
    ],
)
def test_a_signal_to_one_rank_or_the_launcher_stops_every_rank_at_the_same_step_and_the_job_resumes_exactly(
    tmp_path: Path, sig: int, to: str, restarts: int
) -> None:
    steps = 30
    r = torchrun(2, "ddp-train", tmp_path / "reference", tmp_path, steps=steps, save_at=steps)
    assert r.returncode == 0, r.stderr[-3000:]
    store = tmp_path / "store"
    p = torchrun(
        2, "ddp-preempt", store, tmp_path, steps=steps, wait=False, launcher="hindsight.torchrun", restarts=restarts
    )
    pid1 = tmp_path / "pid-1"
    deadline = time.monotonic() + 120
    while not pid1.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # some steps in
    ranks = [int((tmp_path / f"pid-{r}").read_text()) for r in (0, 1)]
    for pid in {"rank 1": ranks[1:], "torchrun": [p.pid], "the job": [p.pid, *ranks]}[to]:
        os.kill(pid, sig)
    _, err = p.communicate(timeout=240)
    # Both ranks checkpoint at one step and leave with the checkpoint exit
    # code, and so does the launcher: no traceback, whoever got the signal.
    assert "every rank that stopped (2) exited with the checkpoint code 85" in err, err[-3000:]
    assert p.returncode == 85, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert err.count("checkpointed ck-") == 1, err[-3000:]
    s = hs.Store(store)
    (name,) = s.list()
    stopped = int(name.split("-")[1])
    assert 0 < stopped < steps
    r = torchrun(2, "ddp-preempt", store, tmp_path, steps=steps)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "resumed-0").read_text() == (tmp_path / "resumed-1").read_text() == str(stopped)
    assert_equal(weights(tmp_path / "final-ddp-preempt-2.pt"), weights(tmp_path / "final-ddp-train-2.pt"))


def test_a_checkpoint_may_not_take_a_parts_name(tmp_path: Path) -> None:
    s = hs.Store(tmp_path / "store")
    with pytest.raises(hs.InvalidArgumentError, match="reserved for the parts of multi-rank checkpoints"):
        s.save("ck@hs-part-00000-of-00002", {"w": torch.zeros(2)})
    assert s.list() == []


def test_the_ddp_tutorial_stops_mid_epoch_on_one_ranks_signal_and_resumes_to_the_same_weights(tmp_path: Path) -> None:
    """The zoo's pytorch/examples DDP tutorial (tests/zoo/ddp_torchrun.py)."""
    script = Path(__file__).parent / "zoo" / "ddp_torchrun.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def launch(store: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "hindsight.torchrun", "--standalone", "--nproc_per_node=2"]
        cmd += [str(script), "4", "1", "--store", store]
        return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def final(p: subprocess.Popen[str]) -> str:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        return next(line for line in out.splitlines() if line.startswith("FINAL"))

    reference = final(launch("reference"))
    p = launch("snaps")
    deadline = time.monotonic() + 120
    while not (tmp_path / "snaps" / "manifests" / "snap-1-0.hsm").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # into the second epoch
    os.kill(children(p.pid)[-1], signal.SIGUSR1)
    _, err = p.communicate(timeout=240)
    assert p.returncode == 85, err[-3000:]
    stopped = [n for n in hs.Store(tmp_path / "snaps").list() if n.startswith("snap-") and not n.endswith("-0")]
    assert len(stopped) == 1, stopped  # mid-epoch, one checkpoint for both ranks
    assert final(launch("snaps")) == reference


def test_a_live_tensor_of_another_shape_is_refused_not_filled_with_a_sub_box(tmp_path: Path) -> None:
    s = hs.Store(tmp_path / "store")
    hs.dist.save(s, "ck", {"w": torch.arange(16.0).reshape(4, 4)}).wait()
    live = torch.zeros(2, 4)
    with pytest.raises(hs.InvalidArgumentError, match=r"shape \[4, 4\] there; the live one has shape \[2, 4\]"):
        hs.dist.load(s, "ck", {"w": live})
    assert torch.equal(live, torch.zeros(2, 4))
    got = torch.zeros(4, 4)
    hs.dist.load(s, "ck", {"w": got})
    assert torch.equal(got, torch.arange(16.0).reshape(4, 4))


ATTEMPT = """
import os, sys, time, torch, torch.distributed as dist
import hindsight as hs, hindsight.dist as hd
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(sys.argv[2])
store = hs.Store(sys.argv[1])
hd.save(store, "warm", {"x": torch.zeros(1)}).wait()  # the ranks have agreed on their save attempts
v = float(attempt)
state = {k: torch.full((64,), v) for k in "abcd"}  # replicated: the ranks own two each
if attempt == 1 and rank == 0:
    os._exit(3)  # killed before its part of "ck" is written
if attempt == 2 and rank == 1:
    time.sleep(2)  # rank 0 is ready to commit while only the old part of rank 1 is there
ds = hd.save(store, "ck", state, rank_state={"attempt": attempt})
if attempt == 1:
    ds.part.wait()  # rank 1's part is durable; its job then dies
    os._exit(4)
ds.wait()
dist.destroy_process_group()
"""


def test_a_commit_never_merges_a_part_an_earlier_save_of_the_name_left(tmp_path: Path) -> None:
    """Issue 42, item 1: a save of 'ck' whose rank 0 died leaves rank 1's
    part; the next job's save of 'ck' commits only its own parts (before,
    its rank 0 merged the stale part with its own: half 1.0, half 2.0,
    exit 0, and `verify` said intact)."""
    script = tmp_path / "attempt.py"
    script.write_text(ATTEMPT)
    store = tmp_path / "store"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def job(attempt: int) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        return subprocess.run(
            [*cmd, str(script), str(store), str(attempt)], env=env, capture_output=True, text=True, timeout=300
        )

    assert job(1).returncode != 0
    second = job(2)
    assert second.returncode == 0, second.stderr[-3000:]
    s = hs.Store(store)
    assert "ck" in s.list()
    got = s.load("ck")
    assert {k: sorted(set(got["state"][k].tolist())) for k in "abcd"} == {k: [2.0] for k in "abcd"}, got
    ranks = got["rank_state"]
    assert len(ranks) == 2 and all(v == {"attempt": 2} for v in ranks.values()), ranks
    v = subprocess.run([*hindsight_cmd(), "verify", "--store", str(store)], capture_output=True, text=True, timeout=120)
    assert v.returncode == 0, v.stdout + v.stderr

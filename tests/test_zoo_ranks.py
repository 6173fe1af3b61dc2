"""karpathy/build-nanogpt's `train_gpt2.py` under `python -m hindsight.torchrun`
with 2 gloo ranks (tests/zoo/build_nanogpt.py, adapted as the README says):
DDP with `raw_model = model.module`, tied embeddings, gradient accumulation
with `require_backward_grad_sync` on the last micro-step only, a
DataLoaderLite object whose position advances per rank, an evaluation with
an all_reduce every few steps, and a log file truncated before the loop.

Each check is what a scheduler or a crash does to a job, at a place the
script makes hard: a signal at the first micro-step (rank 0), at the last
micro-step (rank 1, where each rank's gradients are its own), at an
evaluation to the whole process group (as Slurm's time limit or an
HTCondor eviction sends it), and kill -9 of one rank. The job exits 85 (or
fails, for kill -9), the same command resumes the run, and every rank ends
with the weights, the optimizer, the loader position and the log file of an
uninterrupted run, bit for bit. A probe added afterwards replays to the
values a recording with the probe logs, and leaves the recording's files as
they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import hindsight_cmd

pytestmark = [pytest.mark.serial, pytest.mark.fresh_process]

ZOO = Path(__file__).parent / "zoo"
SCRIPT = ZOO / "build_nanogpt.py"
STEPS, EVAL_EVERY = "12", "5"


def launch(cwd: Path, script: Path = SCRIPT, **extra: str) -> subprocess.CompletedProcess[str]:
    if not (cwd / script.name).exists():
        (cwd / script.name).write_text(script.read_text())
    env = {
        **os.environ,
        "HINDSIGHT_HOME": str(cwd / ".hindsight"),
        "HINDSIGHT_CHECKPOINT_EVERY": "3",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ZOO), os.environ.get("PYTHONPATH", "")]),
        "ZOO_OUT": str(cwd / "final.pt"),
        **extra,
    }
    cmd = [sys.executable, "-m", "hindsight.torchrun", "--standalone", "--nproc_per_node=2", script.name]
    # Its own session: a signal to the process group reaches this job only.
    return subprocess.run(
        [*cmd, STEPS, EVAL_EVERY], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, start_new_session=True
    )


def state(cwd: Path) -> list[Any]:
    """Each rank's final state (weights, optimizer, loader position) and the log file."""
    ranks = [torch.load(cwd / f"final.pt.rank{r}", weights_only=False) for r in (0, 1)]
    return [*ranks, (cwd / "log" / "log.txt").read_text()]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def values(cwd: Path, name: str) -> list[tuple[tuple[int, ...], float]]:
    r = subprocess.run(
        [*hindsight_cmd(), "--home", str(cwd / ".hindsight"), "logs", name, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return [(tuple(x["ctx"].values()), x["values"][name]) for x in json.loads(r.stdout)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    cwd = tmp_path_factory.mktemp("reference")
    r = launch(cwd)
    assert r.returncode == 0, r.stderr[-4000:]
    return cwd, state(cwd)


@pytest.mark.parametrize(
    ("at", "sig", "rank", "to"),
    [
        ("6:0", "TERM", "0", "self"),  # the first micro-step, one rank
        ("7:3", "USR1", "1", "self"),  # the last: gradients all-reduced, the optimizer step not taken yet
        ("6:2", "USR1", "1", "self"),  # between unsynchronised micro-steps: each rank's own gradients
        ("4:3", "INT", "0", "launcher"),  # the launcher alone
        ("10:eval", "TERM", "0", "group"),  # after the evaluation's all_reduce, to the whole job
        ("5:0", "USR1", "1", "group"),  # right after an evaluation, to the whole job
        ("7:2", "KILL", "1", "self"),  # one rank killed: the other's collective fails
    ],
    ids=["first-micro", "last-micro", "mid-accumulation", "launcher", "eval-group", "after-eval-group", "kill-9"],
)
def test_build_nanogpt_under_torchrun_resumes_exactly_from_each_interruption(
    tmp_path: Path, reference: tuple[Path, list[Any]], at: str, sig: str, rank: str, to: str
) -> None:
    _, want = reference
    stopped = launch(
        tmp_path,
        ZOO_SIGNAL_AT=at,
        ZOO_SIGNAL=sig,
        ZOO_SIGNAL_RANK=rank,
        ZOO_SIGNAL_TO=to,
        ZOO_SIGNAL_FLAG=str(tmp_path / "signalled"),
    )
    assert (tmp_path / "signalled").exists(), stopped.stderr[-3000:]
    if sig == "KILL":
        assert stopped.returncode != 0
        assert "another rank of the job was lost" in stopped.stderr, stopped.stderr[-3000:]
    else:
        assert stopped.returncode == 85, stopped.stderr[-3000:]
        assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    resumed = launch(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "continues from checkpoint" in resumed.stderr, resumed.stderr[-3000:]
    assert same(state(tmp_path), want)


def test_a_probe_added_to_build_nanogpt_replays_to_the_values_a_recording_with_it_logs(
    tmp_path: Path, reference: tuple[Path, list[Any]]
) -> None:
    ref_dir, want = reference
    text = SCRIPT.read_text()
    probed = text.replace("# zoo: step-probe: norm.item()", 'hs.log("zoo_norm", norm.item())').replace(
        "# zoo: eval-probe: val_loss_accum.item()", 'hs.log("zoo_val", val_loss_accum.item())'
    )
    assert probed.count('hs.log("zoo_') == 2
    # The truth: a recording with the probes in place.
    truth = tmp_path / "truth"
    truth.mkdir()
    (truth / SCRIPT.name).write_text(probed)
    assert launch(truth).returncode == 0
    # The reference run, probed afterwards and replayed.
    (ref_dir / SCRIPT.name).write_text(probed)
    log_before = (ref_dir / "log" / "log.txt").read_text()
    r = subprocess.run(
        [*hindsight_cmd(), "replay", SCRIPT.name],
        cwd=ref_dir,
        env={
            **os.environ,
            "HINDSIGHT_HOME": str(ref_dir / ".hindsight"),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ZOO), os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "replayed 12 iteration(s)" in r.stdout, r.stdout[-2000:]
    for name in ("zoo_norm", "zoo_val"):
        got = values(ref_dir, name)
        assert got and got == values(truth, name), name
    # The replay ran the script's `open(log_file, "w")` in its own mirror.
    assert (ref_dir / "log" / "log.txt").read_text() == log_before == want[2]

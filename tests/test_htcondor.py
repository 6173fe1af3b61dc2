"""The HTCondor submit-file example, run as a pool would run it: evicted
twice, each time on another execute node that has only what the job's
checkpoint files carried, and ending with the weights of a run never
interrupted. The pool is a stand-in (`condorutil`: no HTCondor can be
installed here); the job, its signals and its files are real."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from condorutil import run_job

from conftest import REPO

SUBMIT = REPO / "examples" / "batch" / "htcondor.sub"
EPOCHS = 12  # the example trains 50; fewer keep the test short


def job_env() -> dict[str, str]:
    """This machine's environment, `python` being the tests' interpreter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HINDSIGHT_", "_CONDOR_"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def arguments() -> dict[str, str]:
    return {"arguments": f"python preemptible_train.py --epochs {EPOCHS} --out final.pt"}


def at_step_of_epoch(epoch: int) -> Callable[[str], bool]:
    return lambda line: line.startswith(f"step {epoch} ")


def submit_dir(tmp: Path) -> Path:
    d = tmp / "submit"
    (d / "examples").mkdir(parents=True)
    (d / "examples" / "preemptible_train.py").write_bytes((REPO / "examples" / "preemptible_train.py").read_bytes())
    return d


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    d = tmp_path_factory.mktemp("plain")
    (d / "preemptible_train.py").write_bytes((REPO / "examples" / "preemptible_train.py").read_bytes())
    r = subprocess.run(
        [sys.executable, "preemptible_train.py", "--epochs", str(EPOCHS), "--out", "final.pt"],
        cwd=d,
        env={**job_env(), "HINDSIGHT_HOME": ".hindsight"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    return torch.load(d / "final.pt")


def test_the_example_job_evicted_twice_resumes_on_fresh_nodes_to_the_uninterrupted_weights(tmp_path, uninterrupted):
    sub = submit_dir(tmp_path)
    job = run_job(
        SUBMIT,
        tmp_path / "pool",
        submit_dir=sub,
        evictions=[at_step_of_epoch(3), at_step_of_epoch(8)],
        env=job_env(),
        overrides=arguments(),
    )
    codes = [a.exit_code for a in job.attempts]
    assert codes == [85, 85, 0], [a.stdout[-2000:] for a in job.attempts]
    assert [a.evicted for a in job.attempts] == [True, True, False]
    # Each rerun started from the checkpoint files alone, on its own node, and
    # did not train the epochs finished before the eviction again.
    for a in job.attempts[1:]:
        assert "resuming run" in a.stdout, a.stdout[-2000:]
        assert "step 0 " not in a.stdout
    weights = torch.load(sub / "final.pt")
    assert all(torch.equal(weights[k], uninterrupted[k]) for k in uninterrupted)
    assert (sub / ".hindsight" / "logs.db").exists()  # transfer_output_files came back


def test_the_exit_code_is_the_job_ads_checkpoint_exit_code(tmp_path, uninterrupted):
    """A pool that asks for another checkpoint exit code gets it: hindsight
    reads CheckpointExitCode from $_CONDOR_JOB_AD, not its default 85."""
    sub = submit_dir(tmp_path)
    job = run_job(
        SUBMIT,
        tmp_path / "pool",
        submit_dir=sub,
        evictions=[at_step_of_epoch(2)],
        env=job_env(),
        overrides={**arguments(), "checkpoint_exit_code": "77"},
    )
    assert [a.exit_code for a in job.attempts] == [77, 0], [a.stdout[-2000:] for a in job.attempts]
    weights = torch.load(sub / "final.pt")
    assert all(torch.equal(weights[k], uninterrupted[k]) for k in uninterrupted)


def test_a_missing_input_file_holds_the_job(tmp_path):
    sub = tmp_path / "empty"
    sub.mkdir()
    with pytest.raises(FileNotFoundError, match=r"preemptible_train\.py"):
        run_job(SUBMIT, tmp_path / "pool", submit_dir=sub, evictions=[], env=job_env(), overrides=arguments())

"""Preemption on a real Slurm cluster (Debian's slurm-wlm on loopback, see
slurmutil.py): the signal comes from Slurm, the job requeues itself with
`scontrol requeue`, Slurm starts it again under the same job id, and the
training ends bit-identical to one that was never interrupted."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_preempt import series, uninterrupted
from test_replay import INNER_PROBE, PRE_PROBE, edit, record_project, record_reference, replay, values

from conftest import REPO

pytestmark = pytest.mark.slurm
SCRIPT = REPO / "examples" / "preemptible_train.py"


def _sbatch(tmp: Path, *directives: str, delay: float) -> str:
    """Submit the preemptible example as the README's batch script does; returns the job id."""
    script = tmp / "train.sbatch"
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives)]
    lines += [
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={tmp}/job.out",
        "export HINDSIGHT_SLURM_REQUEUE=1",
        f"export HINDSIGHT_HOME={tmp}/home",
        f"cd {tmp}",
        # exec: python is the batch shell, so the signal reaches hindsight.
        f"exec {sys.executable} {SCRIPT} --delay {delay} --out {tmp}/final.pt",
    ]
    script.write_text("\n".join(lines) + "\n")
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip().split(";")[0]


def _job(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30, check=True)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def _follow(job: str, tmp: Path, limit: float) -> dict[str, str]:
    """Wait for the job to end. A requeued job waits for a begin time Slurm
    sets about two minutes ahead; the test moves it to now (as an admin
    could) so that the suite does not wait."""
    deadline = time.monotonic() + limit
    held_since: float | None = None
    while time.monotonic() < deadline:
        info = _job(job)
        state = info.get("JobState")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return info
        if state == "PENDING" and info.get("Reason") == "BeginTime":
            # Not at once: slurmd refuses a credential from the same second as
            # the revoked one ("Job credential revoked"), which the delay avoids.
            held_since = held_since or time.monotonic()
            if time.monotonic() - held_since > 3:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=30, check=False)
        else:
            held_since = None
        time.sleep(0.5)
    log = (tmp / "job.out").read_text() if (tmp / "job.out").exists() else ""
    subprocess.run(["scancel", job], timeout=30, check=False)
    raise AssertionError(f"job {job} did not end within {limit:.0f}s: {_job(job)}\n{log[-3000:]}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict]:
    return uninterrupted(tmp_path_factory.mktemp("ref"))


def _check_exact(tmp: Path, info: dict[str, str], reference: tuple[dict[str, torch.Tensor], dict]) -> str:
    log = (tmp / "job.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert int(info["Restarts"]) >= 1, f"the job was never requeued:\n{log[-3000:]}"
    assert "exiting with 85" in log
    assert "resuming run" in log, log[-3000:]
    final = torch.load(tmp / "final.pt")
    ref_weights, ref_series = reference
    for k, v in ref_weights.items():
        assert torch.equal(final[k], v), k
    got = series(tmp / "home")
    assert got["status"] == "completed"
    assert got["logs"] == ref_series["logs"]  # every step's loss and batch, in order, once
    return log


def test_scancel_usr1_requeues_and_resumes_exactly(slurm, tmp_path, reference):
    """`scancel --batch --signal=USR1` mid-epoch: checkpoint, `scontrol
    requeue`, exit 85; Slurm runs the job again, which resumes at the next step."""
    job = _sbatch(tmp_path, delay=0.05)
    deadline = time.monotonic() + 120
    out = tmp_path / "job.out"
    while not (out.exists() and len(re.findall(r"^step 1 ", out.read_text(), re.M)) >= 3):
        assert time.monotonic() < deadline, _job(job)
        assert _job(job)["JobState"] in ("PENDING", "RUNNING"), out.read_text() if out.exists() else _job(job)
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], timeout=30, check=True)
    info = _follow(job, tmp_path, 240)
    log = _check_exact(tmp_path, info, reference)
    assert "SIGUSR1" in log


@pytest.mark.slow
def test_time_limit_signal_requeues_until_done(slurm, tmp_path, reference):
    """`sbatch --time=3 --signal=B:USR1@100`: Slurm itself warns the job before
    its time limit; each attempt checkpoints, requeues and resumes, until the
    training is done.

    Slurm sends the warning at its first periodic check (every 30 s) from
    which the next would be too late: up to 30 s early. With `--time=1
    --signal=B:USR1@50` that is any time from the job's start, and a warning
    in the first second killed Python before any handler existed (the job
    ended FAILED with an empty log). Here it comes 50-80 s in."""
    # 80 steps of 1.2 s outlast the warning; the resumed attempt finishes
    # (at most ~45 s of steps left) before a second one would come.
    job = _sbatch(tmp_path, "--time=3", "--signal=B:USR1@100", delay=1.2)
    info = _follow(job, tmp_path, 420)
    _check_exact(tmp_path, info, reference)


# --------------------------------------------------------------- replay


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_reference(tmp_path_factory.mktemp("reference-replay"))


@pytest.fixture
def recorded_project(tmp_path: Path) -> tuple[Path, Path]:
    return record_project(tmp_path / "proj")


def test_replay_as_a_slurm_job_array_matches_the_reference(slurm, recorded_project, reference_run):
    """`--launcher slurm -j 2`: two array tasks, each writing its own database
    (merged into logs.db as tasks end); values equal a run that logged the
    probes from the start."""
    script, home = recorded_project
    edit(script, INNER_PROBE, PRE_PROBE)
    r = replay(script, home, "--launcher", "slurm", "-j", "2", "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Slurm job array" in r.stdout and "2 task(s)" in r.stdout
    got = values(home, "grad_norm", "start_norm")
    want = values(reference_run, "grad_norm", "start_norm")
    probed = {ctx: v for ctx, v in want.items() if v}
    assert len(probed) == 5 * 6 + 5
    for ctx, v in probed.items():
        assert got[ctx] == v, ctx
    assert list((home / "replay").iterdir()) == []  # the tasks' files are gone once merged


def test_a_failed_slurm_task_is_reported_and_the_other_tasks_values_kept(slurm, recorded_project):
    script, home = recorded_project
    edit(
        script,
        (
            "        sched.step()\n",
            '        sched.step()\n        hs.log("late", 1 / 0 if epoch == 4 else epoch)\n',
        ),
    )
    r = replay(script, home, "--launcher", "slurm", "-j", "2")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "failed with exit code 1" in r.stderr and "ZeroDivisionError" in r.stderr
    assert "tasks' files are kept in" in r.stderr
    assert not re.search(r"replayed \d+ iteration", r.stdout), r.stdout
    assert re.search(r"FAILED \(1 of \d+ worker\(s\) failed\)", r.stdout), r.stdout
    got = {ctx: v["late"] for ctx, v in values(home, "late").items() if v}
    assert got == {(("epoch", e),): e for e in range(4)}


# ------------------------------------------------------- multi-rank jobs


@pytest.mark.parametrize("how", ["scancel", pytest.param("--signal", marks=pytest.mark.slow)])
def test_scancel_term_to_a_torchrun_step_checkpoints_every_rank_and_the_step_exits_85(slurm, tmp_path, how):
    """Issue 43: `scancel --signal=TERM` signals every process of the job's
    steps, the launcher and the ranks at once; `#SBATCH --signal=USR1@100`
    signals the job's steps before the time limit. `srun
    python -m hindsight.torchrun` passes it on, the ranks checkpoint at one
    step, and the step exits 85, with no traceback (torchrun's own handler
    exited 1; SIGUSR1 killed it).

    Slurm sends the time warning at its first periodic check (every 30 s)
    from which the next would be too late: with `--time=3` and `@100`,
    50-80 s in; 1,200 steps of 0.1 s outlast it."""
    worker = REPO / "tests" / "dist_worker.py"
    store, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    script = tmp_path / "ddp.sbatch"
    script.write_text(
        "\n".join(
            [
                "#!/bin/bash",
                "#SBATCH --ntasks=1",
                "#SBATCH --cpus-per-task=2",
                f"#SBATCH --output={tmp_path}/job.out",
                *(["#SBATCH --time=3", "#SBATCH --signal=USR1@100"] if how == "--signal" else []),
                "export OMP_NUM_THREADS=1",
                f"srun {sys.executable} -m hindsight.torchrun "
                f"--standalone --nproc_per_node=2 {worker} ddp-preempt {store} {out} 1200 1200",
                f"echo $? > {tmp_path}/step-code",
            ]
        )
        + "\n"
    )
    job = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=30, check=True
    ).stdout.strip()
    deadline = time.monotonic() + 180
    while not (out / "pid-1").exists():
        assert time.monotonic() < deadline, _job(job)
        assert _job(job)["JobState"] in ("PENDING", "RUNNING"), _job(job)
        time.sleep(0.2)
    if how == "scancel":
        time.sleep(1.5)  # some steps in
        subprocess.run(["scancel", "--signal=TERM", job], timeout=30, check=True)
    info = _follow(job, tmp_path, 240)
    log = (tmp_path / "job.out").read_text()
    assert (tmp_path / "step-code").read_text().strip() == "85", log[-3000:]
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert "every rank that stopped (2) exited with the checkpoint code 85" in log, log[-3000:]
    assert "Traceback" not in log and "SignalException" not in log, log[-3000:]
    import hindsight as hs

    (name,) = hs.Store(store).list()
    assert name.startswith("ck-")

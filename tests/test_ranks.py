"""An `hs.loop` recording under `torchrun` is one run of the job: rank 0
owns it (its rows, its logged values, its decisions; `rank="all"` keeps
every rank's values with its rank), every rank saves its
part of each checkpoint, committed once. A signal to one rank stops every
rank at one step with the checkpoint exit code; the relaunch resumes the
same run to the weights and the values of an uninterrupted one. What
cannot be exact is refused: a resume on another world size (unless asked
to reshard; an elastic job that loses a node does). A replay runs
its workers as torchrun jobs of the recorded size, each rank checking its
own batches and state. The script is the zoo's pytorch/examples DDP tutorial,
adapted as the README says (tests/zoo/ddp_tutorial_loop.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import hindsight as hs
from hindsight import _native

from conftest import children, hindsight_cmd

# Several ranks per test on 2 cores: beside another test's load a rank aborted
# at exit (C++ terminate, exit -6), so these run alone; their launchers start
# afresh (a forked launcher failed in the serial phase; docs/testing.md).
pytestmark = [pytest.mark.serial, pytest.mark.fresh_process]

ZOO = Path(__file__).parent / "zoo" / "ddp_tutorial_loop.py"
EPOCHS = 3
STEPS = 8  # 512 examples, 2 ranks, batches of 32


def launch(cwd: Path, n: int, *, wait: bool = True, sleep: float = 0.0, script: Path = ZOO, **extra: str) -> Any:
    """The job under hindsight's torchrun wrapper (torchrun's arguments,
    exit 85 when every rank that stopped checkpointed)."""
    if not (cwd / script.name).exists():
        shutil.copy(script, cwd / script.name)
    env = {
        **os.environ,
        "HINDSIGHT_HOME": str(cwd / ".hindsight"),
        "HINDSIGHT_CHECKPOINT_EVERY": "1",
        "OMP_NUM_THREADS": "1",
        "ZOO_SLEEP": str(sleep),
        **extra,
    }
    cmd = [sys.executable, "-m", "hindsight.torchrun", "--standalone", f"--nproc_per_node={n}", script.name]
    cmd += [str(EPOCHS)] if script == ZOO else []
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return p
    out, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def final(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, r.stderr[-4000:]
    return next(line for line in r.stdout.splitlines() if line.startswith("FINAL"))


def cli(cwd: Path, *args: str) -> Any:
    r = subprocess.run(
        [*hindsight_cmd(), "--home", str(cwd / ".hindsight"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r


def runs(cwd: Path) -> list[dict[str, Any]]:
    r = cli(cwd, "runs", "--json")
    assert r.returncode == 0, r.stderr
    out: list[dict[str, Any]] = json.loads(r.stdout)
    return out


def losses(cwd: Path, name: str = "loss") -> list[tuple[tuple[int, ...], int, float]]:
    """(context, occurrence, value) of each recorded ``name``, in context order."""
    r = cli(cwd, "logs", name, "--json")
    assert r.returncode == 0, r.stderr
    return [(tuple(x["ctx"].values()), x["rep"], x["values"][name]) for x in json.loads(r.stdout)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The job run once without interruption: its project, its final weights."""
    cwd = tmp_path_factory.mktemp("reference")
    return cwd, final(launch(cwd, 2))


def test_one_launch_is_one_run_with_rank_0s_values_and_one_committed_checkpoint_per_save(
    reference: tuple[Path, str],
) -> None:
    cwd, _ = reference
    [run] = runs(cwd)
    assert run["status"] == "completed"
    # One value per step: rank 0's (both ranks' would be two per step).
    loss = losses(cwd)
    assert [(c, rep) for c, rep, _ in loss] == [((e, s), 0) for e in range(EPOCHS) for s in range(STEPS)]
    # rank="all": each rank's value of each step, with its rank; rank 0's is the loss above.
    per_rank = losses(cwd, "rank_loss")
    assert [(c, rep) for c, rep, _ in per_rank] == [
        ((e, s, r), 0) for e in range(EPOCHS) for s in range(STEPS) for r in (0, 1)
    ]
    assert [v for c, _, v in per_rank if c[2] == 0] == [v for _, _, v in loss]
    assert [v for c, _, v in per_rank if c[2] == 1] != [v for _, _, v in loss]
    store = hs.Store(cwd / ".hindsight" / "store")
    names = store.list()
    assert names == [f"{run['id']}.epoch-{i:06d}" for i in range(EPOCHS)]
    assert all(store.info(n)["meta"]["hs.world"] == "2" for n in names)
    manifests = sorted(p.name for p in (cwd / ".hindsight" / "store" / "manifests").iterdir())
    assert manifests == [f"{n}.hsm" for n in names]  # no rank's part left behind


def test_a_signal_to_one_rank_stops_the_job_and_the_relaunch_resumes_its_run_exactly(
    tmp_path: Path, reference: tuple[Path, str]
) -> None:
    ref_dir, ref_final = reference
    stopped = interrupt(tmp_path, ZOO)
    [run] = runs(tmp_path)
    assert run["status"] == "interrupted"
    assert ".step-" in stopped, stopped  # mid-epoch: both ranks at the same step, one checkpoint

    # Another world size cannot continue each rank's RNG stream and data
    # position: refused, and the run is left to resume.
    one = launch(tmp_path, 1)
    assert one.returncode != 0
    assert f"checkpoint {stopped} was saved by 2 ranks and this launch has one process" in one.stderr, one.stderr[
        -3000:
    ]
    assert [r["status"] for r in runs(tmp_path)] == ["interrupted"]

    # Rank 1's data order changed (its sampler's seed): its skipped batches
    # differ from the ones it recorded. Every rank stops, naming rank 1's
    # first one, rather than train on other data.
    skewed = launch(tmp_path, 2, ZOO_RANK1_SEED="7")
    assert skewed.returncode != 0
    step = int(stopped.rsplit("-", 1)[1])
    assert "DivergenceError" in skewed.stderr and "rank 1's batch at epoch 1, step 0 differs" in skewed.stderr, (
        skewed.stderr[-3000:]
    )
    assert skewed.stderr.count("rank 1's batch at epoch 1, step 0 differs") >= 2  # on both ranks
    assert step > 0
    assert [r["status"] for r in runs(tmp_path)] == ["interrupted"]  # left to resume

    assert final(launch(tmp_path, 2)) == ref_final
    # The same run, completed; every step's value once, equal to the uninterrupted run's.
    assert [(r["id"], r["status"]) for r in runs(tmp_path)] == [(run["id"], "completed")]
    assert losses(tmp_path) == losses(ref_dir)
    assert losses(tmp_path, "rank_loss") == losses(ref_dir, "rank_loss")


def test_a_signal_between_unsynchronised_micro_steps_saves_each_ranks_gradients_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    """Issue 43: gradient accumulation as build-nanogpt writes it
    (`require_backward_grad_sync = last micro-step`): between micro-steps
    each rank's gradients are its own. A signal there checkpoints them per
    rank (it failed: "a value all ranks save must be the same"), and the
    relaunch ends with the weights of an uninterrupted run."""
    ref = tmp_path / "reference"
    ref.mkdir()
    want = final(launch(ref, 2, ZOO_ACCUM="8"))
    job = tmp_path / "job"
    job.mkdir()
    stopped = interrupt(job, ZOO, ZOO_ACCUM="8")
    assert ".step-" in stopped, stopped  # inside an epoch: mid-accumulation
    assert final(launch(job, 2, ZOO_ACCUM="8")) == want


PROBES = (
    ('                    time.sleep(float(os.environ.get("ZOO_SLEEP", "0.02")))\n'),
    (
        '                    time.sleep(float(os.environ.get("ZOO_SLEEP", "0.02")))\n'
        '                    hs.log("{src}", source.sum().item(), rank="all")\n'
        '                hs.log("wsum", sum(p.double().sum().item() for p in self.model.parameters()))\n'
    ),
)


def with_probes(cwd: Path, src: str = "rank_src") -> None:
    """The zoo script with a per-rank step probe (each rank's batch) and an
    epoch probe (the weights after the steps) added, as a user would."""
    cwd.mkdir(exist_ok=True)
    text = ZOO.read_text()
    assert PROBES[0] in text
    (cwd / ZOO.name).write_text(text.replace(PROBES[0], PROBES[1].format(src=src)))


def replay(
    cwd: Path, script: str = ZOO.name, args: tuple[str, ...] = (), **extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*hindsight_cmd(), "replay", script, *args],
        cwd=cwd,
        env={**os.environ, "HINDSIGHT_HOME": str(cwd / ".hindsight"), "OMP_NUM_THREADS": "1", **extra},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_multi_rank_run_replays_on_its_world_size_to_the_values_a_recording_with_the_probes_logs(
    tmp_path: Path,
) -> None:
    """`hindsight replay` of a torchrun run: its workers are torchrun jobs of
    the recorded size; every rank restores its own state, checks its own
    batches, and the values (rank 0's, and every rank's with rank="all")
    equal those of a recording that had the probes from the start."""
    recorded, probed = tmp_path / "recorded", tmp_path / "probed"
    recorded.mkdir()
    final(launch(recorded, 2))
    [run] = runs(recorded)
    with_probes(recorded)
    r = replay(recorded)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "new values: rank_src, wsum" in r.stdout, r.stdout
    with_probes(probed)
    final(launch(probed, 2))
    assert losses(recorded, "rank_src") == losses(probed, "rank_src")
    assert [c for c, _, _ in losses(recorded, "rank_src")] == [
        (e, s, k) for e in range(EPOCHS) for s in range(STEPS) for k in (0, 1)
    ]
    assert losses(recorded, "wsum") == losses(probed, "wsum")
    assert [(x["id"], x["status"]) for x in runs(recorded)] == [(run["id"], "completed")]

    # Rank 1's data order is not the recorded one: the replay stops at its
    # first batch, naming the rank, and keeps none of its values.
    with_probes(recorded, src="rank_src_skewed")
    r = replay(recorded, ZOO_RANK1_SEED="7")
    assert r.returncode == _native.EXIT_DIVERGED, r.stdout + r.stderr[-4000:]
    assert "hindsight: rank 1: replay of run" in r.stderr and "the batch at epoch 0, step 0 differs" in r.stderr, (
        r.stderr[-4000:]
    )
    kept = cli(recorded, "logs", "rank_src_skewed", "--json")
    assert kept.returncode != 0 and "never logged 'rank_src_skewed'" in kept.stderr, kept.stderr

    # Rank 1 computes otherwise (its loss scaled): the same batches, other
    # weights after the epoch; the check against the checkpoint stops it.
    r = replay(recorded, ZOO_RANK1_SCALE="1.5")
    assert r.returncode == _native.EXIT_DIVERGED, r.stdout + r.stderr[-4000:]
    assert "after epoch 0, the state differs from the recorded checkpoint" in r.stderr, r.stderr[-4000:]


@pytest.mark.slurm
def test_a_multi_rank_run_replays_as_a_slurm_job_array(slurm: dict[str, str], tmp_path: Path) -> None:
    """`--launcher slurm`: each replay worker of the 2-rank run is a torchrun
    job of 2 ranks inside its array task (which asks for both ranks'
    threads); the per-rank and epoch values equal those of a recording
    that had the probes from the start, and the run is still one run."""
    recorded, probed = tmp_path / "recorded", tmp_path / "probed"
    recorded.mkdir()
    final(launch(recorded, 2))
    [run] = runs(recorded)
    with_probes(recorded)
    r = replay(recorded, args=("--launcher", "slurm", "-j", "2"))
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "Slurm job array" in r.stdout and "new values: rank_src, wsum" in r.stdout, r.stdout
    with_probes(probed)
    final(launch(probed, 2))
    assert losses(recorded, "rank_src") == losses(probed, "rank_src")
    assert {c[2] for c, _, _ in losses(recorded, "rank_src")} == {0, 1}
    assert losses(recorded, "wsum") == losses(probed, "wsum")
    assert [(x["id"], x["status"]) for x in runs(recorded)] == [(run["id"], "completed")]


def test_an_epoch_level_probe_of_a_multi_rank_run_replays_on_one_process(tmp_path: Path) -> None:
    """A probe after the inner loop needs no training step: the replay
    restores each epoch's checkpoint of the FSDP2 job, saved by 2 ranks, on
    one process (the shards resharded onto it), and logs what a recording
    with the probe from the start logged on 2."""
    script = Path(__file__).with_name("ranks_fsdp.py")
    inner_end = '            time.sleep(float(os.environ.get("ZOO_SLEEP", "0")))\n'
    probe = '        hs.log("wsum", sum(v.full_tensor().double().sum().item() for v in m.state_dict().values()))\n'
    text = script.read_text()
    assert inner_end in text
    probed = text.replace(inner_end, inner_end + probe)
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / script.name).write_text(probed)
    final(launch(tmp_path / "ref", 2, script=script))
    final(launch(tmp_path, 2, script=script))
    (tmp_path / script.name).write_text(probed)
    r = replay(tmp_path, script.name)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "partial replay of wsum" in r.stdout and "0 inner-loop steps executed" in r.stdout, r.stdout
    assert "only restores run" in r.stderr and "on one process" in r.stderr, r.stderr[-3000:]
    assert losses(tmp_path, "wsum") == losses(tmp_path / "ref", "wsum")
    assert len(losses(tmp_path, "wsum")) == 3


def test_epoch_probes_whose_values_need_the_ranks_stop_on_one_process_and_replay_on_the_recorded_ranks(
    tmp_path: Path,
) -> None:
    """The epoch code all_reduces a value over the ranks (a validation
    loss's shape) and a new probe logs it, or a new probe passes over the
    rank's share of the data: on one process each would be one process's
    value, wrong, with no recorded one to check it. The one-process worker
    stops, naming the call and --recorded-ranks; with it, the restore-only
    worker runs on the 2 recorded ranks and logs what a recording with the
    probes logged."""
    recorded, probed = tmp_path / "recorded", tmp_path / "probed"
    text = ZOO.read_text()
    assert PROBES[0] in text
    reduced = (
        "                t = torch.tensor([sum(p.double().sum().item() for p in self.model.parameters())])\n"
        "                torch.distributed.all_reduce(t)\n"
    )
    base = text.replace(PROBES[0], PROBES[0] + reduced)
    w_all = reduced + '                hs.log("w_all", t.item())\n'
    # An epoch-end pass over the rank's share of the training set.
    seen = '                hs.log("seen", sum(len(x) for x, _ in self.train_data))\n'
    for d in (recorded, probed):
        d.mkdir()
    # (The pass draws the loader's seed from the global RNG: a recording
    # with it trains otherwise; its value is each rank's share, 512 / 2.)
    (probed / ZOO.name).write_text(base.replace(reduced, w_all))
    final(launch(probed, 2))
    (recorded / ZOO.name).write_text(base)
    final(launch(recorded, 2))
    (recorded / ZOO.name).write_text(base.replace(reduced, w_all))
    r = replay(recorded)
    assert r.returncode != 0, r.stdout + r.stderr[-4000:]
    assert "calls torch.distributed.all_reduce, whose value depends on the world size" in r.stderr, r.stderr[-4000:]
    assert "hindsight replay --recorded-ranks" in r.stderr
    (recorded / ZOO.name).write_text(base.replace(reduced, seen + reduced))
    r = replay(recorded)
    assert r.returncode != 0, r.stdout + r.stderr[-4000:]
    assert "epoch code iterates a DistributedSampler over 1 replica(s)" in r.stderr, r.stderr[-4000:]
    (recorded / ZOO.name).write_text(base.replace(reduced, w_all + seen))
    r = replay(recorded, args=("--recorded-ranks",))
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "partial replay of seen, w_all" in r.stdout and "0 inner-loop steps executed" in r.stdout, r.stdout
    assert losses(recorded, "w_all") == losses(probed, "w_all")
    assert len(losses(recorded, "w_all")) == EPOCHS
    assert [v for _, _, v in losses(recorded, "seen")] == [256] * EPOCHS


def test_the_ddp_tutorials_epoch_probe_in_its_trainer_method_replays_on_one_process(tmp_path: Path) -> None:
    """The zoo's DDP tutorial runs its loops in `Trainer.train`, called as
    `trainer.train(n)`: a probe after the inner loop has a place (it was
    re-executed on every rank before), so the replay restores each epoch's
    checkpoint on one process; the weights it logs are the ones the 2-rank
    job started the next epoch with."""
    recorded = final(launch(tmp_path, 2))
    start = {c: v for c, _, v in losses(tmp_path, "w_start")}
    text = (tmp_path / ZOO.name).read_text()
    step_end = '                    time.sleep(float(os.environ.get("ZOO_SLEEP", "0.02")))\n'
    probe = '                hs.log("w_end", sum(p.double().sum().item() for p in self.model.parameters()))\n'
    assert text.count(step_end) == 1
    (tmp_path / ZOO.name).write_text(text.replace(step_end, step_end + probe))
    r = replay(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "partial replay of w_end" in r.stdout and "0 inner-loop steps executed" in r.stdout, r.stdout
    assert "on one process" in r.stderr, r.stderr[-3000:]
    end = {c: v for c, _, v in losses(tmp_path, "w_end")}
    assert end == {(0,): start[(1,)], (1,): start[(2,)], (2,): float(recorded.split()[1])}


@pytest.mark.parametrize("n", [1, 4])
def test_a_relaunch_on_another_world_size_reshards_when_asked_from_the_newest_checkpoint_between_iterations(
    tmp_path: Path, reference: tuple[Path, str], n: int
) -> None:
    """$HINDSIGHT_RESHARD=1: the job stopped mid-epoch on 2 ranks resumes on
    n. The mid-epoch checkpoint holds each rank's share of the epoch, which
    n ranks do not have: it is skipped, said so, for the epoch-end one.
    What is exact, and compared: the weights the resumed ranks start the
    next epoch with equal the uninterrupted run's at that point. What is
    not (said so): the data order and new ranks' RNG streams from there on."""
    ref_dir, _ = reference
    stopped = interrupt(tmp_path, ZOO)
    [run] = runs(tmp_path)
    epoch0 = f"{run['id']}.epoch-000000"
    r = launch(tmp_path, n, HINDSIGHT_RESHARD="1")
    final(r)
    assert (
        f"HINDSIGHT_RESHARD=1: checkpoint {epoch0} was saved by 2 rank(s) and this launch has {n}" in r.stderr
        and f"skipped, inside an iteration: {stopped}" in r.stderr
    ), r.stderr[-3000:]
    assert f"continues from checkpoint {epoch0} " in r.stderr
    assert [(x["id"], x["status"]) for x in runs(tmp_path)] == [(run["id"], "completed")]
    start = {c: v for c, _, v in losses(tmp_path, "w_start")}
    want = {c: v for c, _, v in losses(ref_dir, "w_start")}
    assert start[(1,)] == want[(1,)] and start[(0,)] == want[(0,)]
    store = hs.Store(tmp_path / ".hindsight" / "store")
    later = store.info(f"{run['id']}.epoch-000001")["meta"].get("hs.world")
    assert later == (None if n == 1 else str(n))  # saved by the new world


def interrupt(cwd: Path, script: Path, n: int = 2, **extra: str) -> str:
    """Launch ``script`` on ``n`` ranks, SIGUSR1 to the last rank in the
    second epoch: the checkpoint the job stopped at."""
    p = launch(cwd, n, wait=False, sleep=0.1, script=script, **extra)
    manifests = cwd / ".hindsight" / "store" / "manifests"
    deadline = time.monotonic() + 120
    while not any(manifests.glob("*.epoch-000000.hsm")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # into the second epoch's steps
    os.kill(children(p.pid)[-1], signal.SIGUSR1)
    _, err = p.communicate(timeout=240)
    assert p.returncode == 85, err[-4000:]
    stopped: str = hs.Store(cwd / ".hindsight" / "store").list()[-1]
    return stopped


def test_hindsight_run_restarts_a_job_whose_rank_crashed_and_it_resumes_the_run(
    tmp_path: Path, reference: tuple[Path, str]
) -> None:
    """`hindsight run -- python -m hindsight.torchrun ...`: rank 1 raises in
    the second epoch, torchrun stops the job, the supervisor restarts it,
    and the run continues from the first epoch's checkpoint (committed at
    the first step boundary after it, not only at the next save)."""
    ref_dir, ref_final = reference
    r = supervised(tmp_path, ZOO_CRASH_EPOCH="1")
    assert final(r) == ref_final
    assert "rank 1 crashed" in r.stderr and "restart 1 of 3" in r.stderr, r.stderr[-3000:]
    [run] = runs(tmp_path)
    assert f"continues from checkpoint {run['id']}.epoch-000000 " in r.stderr, r.stderr[-3000:]
    assert run["status"] == "completed"
    assert losses(tmp_path) == losses(ref_dir)


def test_torchruns_own_restart_of_a_crashed_rank_resumes_the_run(tmp_path: Path, reference: tuple[Path, str]) -> None:
    """`torchrun --max-restarts=1`: rank 1 raises in the second epoch, the
    agent stops the workers and starts them again; the restarted job resumes
    the run (it used to start a new one from scratch: a run that failed
    resumed only under `hindsight run`)."""
    ref_dir, ref_final = reference
    shutil.copy(ZOO, tmp_path / ZOO.name)
    env = {
        **os.environ,
        "HINDSIGHT_HOME": str(tmp_path / ".hindsight"),
        "HINDSIGHT_CHECKPOINT_EVERY": "1",
        "OMP_NUM_THREADS": "1",
        "ZOO_CRASH_EPOCH": "1",
    }
    cmd = [sys.executable, "-m", "hindsight.torchrun", "--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    r = subprocess.run(
        [*cmd, ZOO.name, str(EPOCHS)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert final(r) == ref_final
    assert "rank 1 crashed" in r.stderr
    [run] = runs(tmp_path)
    assert f"continues from checkpoint {run['id']}.epoch-000000 " in r.stderr, r.stderr[-3000:]
    assert run["status"] == "completed"
    assert losses(tmp_path) == losses(ref_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_elastic_job_that_loses_a_node_resumes_on_the_one_left(tmp_path: Path, reference: tuple[Path, str]) -> None:
    """Two torchrun agents (elastic, `--nnodes=1:2`, c10d rendezvous on
    loopback), one rank each. The second agent is killed in the second
    epoch; the first restarts its worker on the one node left, and with
    $HINDSIGHT_RESHARD=1 it resumes the run on one rank from the first
    epoch's checkpoint: the weights it starts the second epoch with are the
    uninterrupted 2-rank run's."""
    ref_dir, _ = reference
    shutil.copy(ZOO, tmp_path / ZOO.name)
    port = free_port()
    env = {
        **os.environ,
        "HINDSIGHT_HOME": str(tmp_path / ".hindsight"),
        "HINDSIGHT_CHECKPOINT_EVERY": "1",
        "HINDSIGHT_RESHARD": "1",
        "OMP_NUM_THREADS": "1",
        "ZOO_SLEEP": "0.1",
    }
    cmd = [
        sys.executable,
        "-m",
        "hindsight.torchrun",
        "--nnodes=1:2",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=zoo",
        "--rdzv-conf=last_call_timeout=1",
        "--max-restarts=1",
        ZOO.name,
        str(EPOCHS),
    ]

    def agent() -> subprocess.Popen[str]:
        return subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    first = agent()
    # The first agent hosts the rendezvous store (the agent that binds the
    # endpoint's port does): the one killed must not be it.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    second = agent()
    manifests = tmp_path / ".hindsight" / "store" / "manifests"
    deadline = time.monotonic() + 120
    while not any(manifests.glob("*.epoch-000000.hsm")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    os.killpg(second.pid, signal.SIGKILL)
    second.communicate(timeout=60)
    out, err = first.communicate(timeout=300)
    r = subprocess.CompletedProcess(cmd, first.returncode, out, err)
    final(r)
    [run] = runs(tmp_path)
    epoch0 = f"{run['id']}.epoch-000000"
    assert f"HINDSIGHT_RESHARD=1: checkpoint {epoch0} was saved by 2 rank(s) and this launch has 1" in err, err[-4000:]
    assert run["status"] == "completed"
    start = {c: v for c, _, v in losses(tmp_path, "w_start")}
    want = {c: v for c, _, v in losses(ref_dir, "w_start")}
    assert start[(1,)] == want[(1,)] and start[(0,)] == want[(0,)]


def running_in(cwd: Path) -> list[int]:
    """The processes whose working directory is ``cwd``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.readlink(f"/proc/{entry}/cwd") == str(cwd):
                found.append(int(entry))
        except OSError:
            pass
    return found


def supervised(cwd: Path, *options: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """The zoo job under `hindsight run [options] -- python -m hindsight.torchrun ...`."""
    shutil.copy(ZOO, cwd / ZOO.name)
    env = {
        **os.environ,
        "HINDSIGHT_HOME": str(cwd / ".hindsight"),
        "HINDSIGHT_CHECKPOINT_EVERY": "1",
        "OMP_NUM_THREADS": "1",
        **extra,
    }
    launcher = [sys.executable, "-m", "hindsight.torchrun", "--standalone", "--nproc_per_node=2"]
    return subprocess.run(
        [*hindsight_cmd(), "run", *options, "--", *launcher, ZOO.name, str(EPOCHS)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_hindsight_run_finds_a_hung_rank_dumps_every_ranks_stacks_kills_the_job_and_it_resumes(
    tmp_path: Path, reference: tuple[Path, str]
) -> None:
    """Rank 1 sleeps in the second epoch; rank 0 waits for it in DDP's
    all-reduce. The ranks beat through the pipe the launcher keeps for
    them (torchrun closes it in its workers), so the supervisor sees the
    beats stop, has every rank dump its Python stacks, kills the job (the
    ranks, in sessions of their own, die with their launcher: none is left
    behind) and restarts it, and the run resumes to the uninterrupted
    weights."""
    ref_dir, ref_final = reference
    r = supervised(tmp_path, "--hang-timeout", "10", "--backoff", "0.1", ZOO_HANG_EPOCH="1")
    assert final(r) == ref_final
    assert "no step boundary for 10 s" in r.stderr, r.stderr[-3000:]
    dump = r.stderr.split("no step boundary")[1].split("hung and was killed")[0]
    # Both ranks' stacks: rank 1 in its sleep, rank 0 in the step waiting for it.
    assert dump.count(f'{ZOO.name}", line') >= 6 and dump.count(" in train\n") == 2, dump
    assert "restart 1 of 3" in r.stderr
    assert not running_in(tmp_path)  # no rank of the killed job outlives it
    assert [x["status"] for x in runs(tmp_path)] == ["completed"]
    assert losses(tmp_path) == losses(ref_dir)


def test_fsdp2_shards_resume_mid_epoch_to_the_weights_of_an_uninterrupted_run(tmp_path: Path) -> None:
    """FSDP2 under hs.loop: each rank saves its shards of the weights, the
    AdamW state and the gradients; the relaunch cuts them back to each
    rank's shards."""
    script = Path(__file__).with_name("ranks_fsdp.py")
    (tmp_path / "ref").mkdir()
    reference = final(launch(tmp_path / "ref", 2, script=script))
    stopped = interrupt(tmp_path, script)
    assert ".step-" in stopped, stopped
    # Each rank reads only its own shards: with rank 1's piece of a weight
    # damaged, rank 1 alone finds it (naming the checkpoint and the key;
    # rank 0 used to read every whole tensor), and the whole job resumes
    # from the checkpoint before (ranks on different checkpoints would
    # train on silently).
    store = tmp_path / ".hindsight" / "store"
    names = hs.Store(store).list()
    for f in pieces_past_the_first(store, stopped, "state/objects/model/0.weight"):
        data = f.read_bytes()
        f.chmod(0o644)
        f.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    r = launch(tmp_path, 2, script=script)
    assert final(r) == reference
    # Rank 1's warning names the key; rank 0 (which speaks for the job) read
    # nothing damaged. (The ranks share one stderr: lines may interleave.)
    assert r.stderr.count(f"checkpoint {stopped} is damaged") == 2, r.stderr[-4000:]
    assert r.stderr.count(f"corrupt checkpoint '{stopped}' at key 'state/objects/model/0.weight'") == 1
    assert r.stderr.count(f"checkpoint {stopped} is damaged (another rank's part)") == 1
    assert f"continues from checkpoint {names[names.index(stopped) - 1]} " in r.stderr, r.stderr[-3000:]
    assert [r["status"] for r in runs(tmp_path)] == ["completed"]

    # Its replay: every rank restores its shards, executes the steps, and
    # its sharded state is checked against the checkpoints' pieces.
    ref = tmp_path / "ref" / script.name
    text = ref.read_text()
    step_line = '            hs.log("loss", loss.item())\n'
    assert step_line in text
    ref.write_text(
        text.replace(step_line, step_line + '            hs.log("rank_loss", loss.item(), rank="all")\n').replace(
            "whole = {",
            '        hs.log("wsum", sum(v.full_tensor().double().sum().item() for v in m.state_dict().values()))\n'
            "whole = {",
        )
    )
    r = replay(tmp_path / "ref", script.name)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "new values: rank_loss, wsum" in r.stdout, r.stdout
    assert repr(losses(tmp_path / "ref", "wsum")[-1][2]) == reference.split()[1]
    assert [v for c, _, v in losses(tmp_path / "ref", "rank_loss") if c[2] == 0] == [
        v for _, _, v in losses(tmp_path / "ref")
    ]
    # Rank 1 computes otherwise: each rank's own shards, compared with the
    # pieces the recording saved (nothing gathered whole), differ.
    r = replay(tmp_path / "ref", script.name, ZOO_RANK1_SCALE="1.5")
    assert r.returncode == _native.EXIT_DIVERGED, r.stdout + r.stderr[-4000:]
    assert "the state differs from the recorded checkpoint" in r.stderr, r.stderr[-4000:]
    assert "values of the piece at" in r.stderr, r.stderr[-4000:]


def pieces_past_the_first(store: Path, name: str, key: str) -> list[Path]:
    """The chunk files of the pieces of the sharded array at ``key`` of
    checkpoint ``name`` that do not start at the origin (rank 1's, of 2)."""
    raw = (store / "manifests" / f"{name}.hsm").read_bytes()
    manifest, _ = json.JSONDecoder().raw_decode(raw[raw.index(b'{"format"') :].decode(errors="replace"))
    node = manifest["root"]
    for k in key.split("/"):
        node = next(v for kk, v in node["v"] if kk["v"] == k)
    assert node["t"] == "sharded", node["t"]
    ids = [c["id"] for piece in node["v"]["shards"] if any(piece["offset"]) for c in piece["array"]["data"]["chunks"]]
    return [store / "chunks" / i[:2] / i[2:] for i in ids]


def test_a_bad_launcher_variable_is_named(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("import hindsight as hs\nhs.arg('lr', 0.1)\n")
    env = {**os.environ, "HINDSIGHT_HOME": str(tmp_path / ".hindsight"), "RANK": "2", "WORLD_SIZE": "2"}
    r = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "RANK=2 is not a rank of WORLD_SIZE=2" in r.stderr, r.stderr


def test_a_recording_under_several_ranks_without_a_process_group_is_refused_and_records_nothing(
    tmp_path: Path,
) -> None:
    (tmp_path / "train.py").write_text(
        "import torch, hindsight as hs\n"
        "m = torch.nn.Linear(2, 2)\n"
        "with hs.checkpointing(model=m):\n"
        "    for epoch in hs.loop('epoch', range(2)):\n"
        "        pass\n"
    )
    env = {**os.environ, "HINDSIGHT_HOME": str(tmp_path / ".hindsight"), "RANK": "0", "WORLD_SIZE": "2"}
    r = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stderr
    assert "rank 0 of 2 (RANK/WORLD_SIZE (torchrun))" in r.stderr and "init_process_group()" in r.stderr, r.stderr
    assert runs(tmp_path) == []


def test_hs_log_takes_rank_0_or_all_and_names_a_bad_rank() -> None:
    with pytest.raises(hs.InvalidArgumentError, match=r"hs.log\('loss', ..., rank=1\): rank must be 0"):
        hs.log("loss", 0.5, rank=1)


# -- FSDP2 on one rank, and on a GPU (`make test-cuda`) ----------------------

CUDA = {"ZOO_DEVICE": "cuda", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fsdp2_on_one_rank_resumes_mid_epoch_and_replays_exactly(tmp_path: Path, device: str) -> None:
    """The FSDP2 job launched by torchrun on one rank (one GPU: NCCL
    refuses two ranks on one device), as a one-GPU user of a multi-GPU
    script does. Its parameters are DTensors even so: they are saved the
    job's way (a plain save refused them, and the run failed at its first
    checkpoint), on the GPU through the pinned arena, and the collectives
    of the step agreement run on NCCL. Interrupted mid-epoch, relaunched:
    the uninterrupted run's weights. Replayed with a step probe: its
    workers run the script under torchrun too (as a plain process it died
    on torchrun's missing variables), every step and state checked."""
    script = Path(__file__).with_name("ranks_fsdp.py")
    env = CUDA if device == "cuda" else {}
    (tmp_path / "ref").mkdir()
    reference = final(launch(tmp_path / "ref", 1, script=script, **env))
    stopped = interrupt(tmp_path, script, 1, **env)
    assert ".step-" in stopped, stopped
    r = launch(tmp_path, 1, script=script, **env)
    assert final(r) == reference
    [run] = runs(tmp_path)
    assert run["status"] == "completed"
    assert losses(tmp_path) == losses(tmp_path / "ref")

    text = (tmp_path / script.name).read_text()
    step_line = '            hs.log("loss", loss.item())\n'
    assert step_line in text
    (tmp_path / script.name).write_text(
        text.replace(step_line, step_line + '            hs.log("loss2", 2 * loss.item())\n')
    )
    r = replay(tmp_path, script.name, **env)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "new values: loss2" in r.stdout, r.stdout
    assert [v for _, _, v in losses(tmp_path, "loss2")] == [2 * v for _, _, v in losses(tmp_path)]
    # Computing otherwise is caught by the check of its DTensors' pieces.
    r = replay(tmp_path, script.name, ZOO_RANK1_SCALE="1", ZOO_RANK0_SCALE="1.5", **env)
    assert r.returncode == _native.EXIT_DIVERGED, r.stdout + r.stderr[-4000:]
    assert "the state differs from the recorded checkpoint" in r.stderr, r.stderr[-4000:]


@pytest.mark.cuda
def test_ddp_on_the_gpu_with_two_ranks_stops_together_and_resumes_exactly(tmp_path: Path) -> None:
    """The zoo DDP tutorial with its model and batches on the GPU, two ranks
    sharing it (gloo carries CUDA tensors): a signal to rank 1 stops both at
    one step, the relaunch resumes the run to the uninterrupted weights and
    per-rank values (each rank's CUDA dropout stream restored)."""
    (tmp_path / "ref").mkdir()
    reference = final(launch(tmp_path / "ref", 2, **CUDA))
    stopped = interrupt(tmp_path, ZOO, **CUDA)
    assert ".step-" in stopped, stopped
    assert final(launch(tmp_path, 2, **CUDA)) == reference
    assert [r["status"] for r in runs(tmp_path)] == ["completed"]
    assert losses(tmp_path, "rank_loss") == losses(tmp_path / "ref", "rank_loss")


def test_hs_run_id_on_a_following_rank_is_refused_before_the_ranks_meet_and_agrees_after(tmp_path: Path) -> None:
    """Rank 1 learns the job's run as the outer loop starts: before that its
    hs.run_id() was "" (a file named from it went astray); now it is
    refused, naming why. Inside the loop every rank has rank 0's id."""
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch, torch.distributed as dist, hindsight as hs\n"
        'dist.init_process_group("gloo")\n'
        "m = torch.nn.Linear(2, 2)\n"
        "try:\n"
        "    early = hs.run_id()\n"
        "except hs.InvalidArgumentError as e:\n"
        "    early = str(e)\n"
        "with hs.checkpointing(model=m):\n"
        '    for epoch in hs.loop("epoch", range(1)):\n'
        "        ids = [None, None]\n"
        "        dist.all_gather_object(ids, hs.run_id())\n"
        # One write per line: torchrun runs ranks with `python -u`, where
        # print's pieces are separate writes that two ranks interleave.
        "sys.stdout.write(f\"RANK {dist.get_rank()} {early} | {' '.join(ids)}\\n\")\n"
        "dist.destroy_process_group()\n"
    )
    r = launch(tmp_path, 2, script=script)
    assert r.returncode == 0, r.stderr[-3000:]
    [run] = runs(tmp_path)
    lines = sorted(line for line in r.stdout.splitlines() if line.startswith("RANK"))
    assert lines[0] == f"RANK 0 {run['id']} | {run['id']} {run['id']}", lines
    assert lines[1].startswith("RANK 1 hs.run_id() on rank 1 before the outer hs.loop starts"), lines
    assert lines[1].endswith(f"| {run['id']} {run['id']}"), lines

"""Hindsight logging end to end: record a real training script, add log
statements, replay, and compare with a run that logged them from the start."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, hindsight_cmd

ARGS = ["--epochs", "5", "--batches", "6"]
OUTER_PROBE = (
    "        sched.step()\n",
    '        sched.step()\n        hs.log("weight_norm", sum(p.norm().item() ** 2 for p in net.parameters()) ** 0.5)\n',
)
PRE_PROBE = (  # before the inner loop: reads the state the previous epoch left
    '        for x, y in hs.loop("step", loader):\n',
    '        hs.log("start_norm", sum(p.norm().item() ** 2 for p in net.parameters()) ** 0.5)\n'
    '        for x, y in hs.loop("step", loader):\n',
)
INNER_PROBE = (
    "            opt.step()\n",
    '            hs.log("grad_norm", sum(p.grad.norm().item() ** 2 for p in net.parameters()) ** 0.5)\n            opt.step()\n',
)


def make_project(root: Path, *edits: tuple[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    src = (REPO / "examples" / "train.py").read_text()
    for old, new in edits:
        assert old in src
        src = src.replace(old, new, 1)
    (root / "train.py").write_text(src)
    return root / "train.py"


def edit(script: Path, *edits: tuple[str, str]) -> None:
    src = script.read_text()
    for old, new in edits:
        assert old in src
        src = src.replace(old, new, 1)
    script.write_text(src)


def env_for(home: Path, **extra: str) -> dict[str, str]:
    # Tiny epochs: the adaptive policy would rightly skip most checkpoints.
    return {**os.environ, "HINDSIGHT_HOME": str(home), "HINDSIGHT_CHECKPOINT_EVERY": "1", **extra}


def record(script: Path, home: Path, args: list[str] = ARGS, **env: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [sys.executable, str(script), *args],
        env=env_for(home, **env),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=script.parent,
    )
    assert r.returncode == 0, r.stderr
    return r


def replay(script: Path, home: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*hindsight_cmd(), "replay", str(script), "-q", *extra],
        env=env_for(home),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=script.parent,
    )


def values(home: Path, *names: str) -> dict[tuple, dict[str, object]]:
    """{ctx tuple: {name: value}} of the latest run, via hs.dataframe in a fresh process."""
    code = (
        "import json, sys, hindsight as hs\n"
        "df = hs.dataframe(*sys.argv[1:])\n"
        "print(df.drop(columns=['run']).to_json(orient='records'))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, *names], env=env_for(home), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    out: dict[tuple, dict[str, object]] = {}
    for row in json.loads(r.stdout):
        ctx = tuple((k, v) for k, v in row.items() if k not in names and k != "rep" and v is not None)
        out[ctx] = {n: row[n] for n in names if row.get(n) is not None}
    return out


def record_reference(root: Path) -> Path:
    """A run that logged the probes from the start; returns its home."""
    script = make_project(root, OUTER_PROBE, INNER_PROBE, PRE_PROBE)
    record(script, root / ".hindsight")
    return root / ".hindsight"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record_reference(tmp_path_factory.mktemp("reference"))


def record_project(root: Path) -> tuple[Path, Path]:
    """A recorded run of the unprobed script: (script, home)."""
    script = make_project(root)
    record(script, root / ".hindsight")
    return script, root / ".hindsight"


@pytest.fixture
def recorded(tmp_path: Path) -> tuple[Path, Path]:
    return record_project(tmp_path / "proj")


# Asserts the plan: beside another test's load the cost rule may rightly execute an epoch instead.
@pytest.mark.serial
def test_outer_loop_probe_replays_without_running_any_step(recorded, reference):
    script, home = recorded
    edit(script, OUTER_PROBE)
    r = replay(script, home, "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "partial replay of weight_norm" in r.stdout
    assert "5 restored from checkpoints, 0 inner-loop steps executed" in r.stdout
    got = values(home, "weight_norm")
    want = values(reference, "weight_norm")
    epochs = {ctx: v for ctx, v in want.items() if "weight_norm" in v}
    assert len(epochs) == 5
    for ctx, v in epochs.items():
        assert got[ctx]["weight_norm"] == v["weight_norm"], ctx


SLOW_TO_LOAD = (  # state whose load_state_dict takes 1 s (an index rebuilt on load): dear to restore
    "with hs.checkpointing(model=net, optimizer=opt, scheduler=sched):",
    "import time\n\n\n"
    "class Index:\n"
    "    def state_dict(self):\n"
    "        return {'rows': 3}\n\n"
    "    def load_state_dict(self, state):\n"
    "        time.sleep(1.0)\n\n\n"
    "with hs.checkpointing(model=net, optimizer=opt, scheduler=sched, index=Index()):",
)


def test_an_iteration_cheaper_to_execute_than_to_restore_is_executed_and_checked(tmp_path, reference):
    """The planner's cost rule: once a restore is measured dearer than the
    iteration was when recorded, the worker executes the next iterations
    from the state their predecessor left (each compared with the checkpoint
    it replaces) instead of restoring them; the values are the reference's."""
    script = make_project(tmp_path / "proj", SLOW_TO_LOAD)
    home = tmp_path / "proj" / ".hindsight"
    record(script, home)
    edit(script, OUTER_PROBE)
    r = replay(script, home, "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    # The first epoch is restored (and measured); the others are executed (6
    # steps each) once a restore is measured dearer, here 1 s against ~10 ms.
    m = re.search(r"(\d+) restored from checkpoints, (\d+) inner-loop steps executed", r.stdout)
    assert m and int(m[1]) + int(m[2]) // 6 == 5 and int(m[2]) >= 18, r.stdout
    got = values(home, "weight_norm")
    want = {ctx: v for ctx, v in values(reference, "weight_norm").items() if "weight_norm" in v}
    assert len(want) == 5
    for ctx, v in want.items():
        assert got[ctx]["weight_norm"] == v["weight_norm"], ctx


def test_a_worker_writing_more_than_a_pipe_holds_to_stderr_does_not_stall(recorded):
    """A chatty worker (warnings, a probe that prints) writes more to standard
    error than a pipe buffers; the replay reads it as it comes, finishes, and
    shows its tail."""
    script, home = recorded
    old, new = OUTER_PROBE
    edit(script, (old, new + "        import sys\n        print('w' * 100_000 + ' end', file=sys.stderr)\n"))
    r = replay(script, home, "--strict")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert "replayed 5 iteration(s)" in r.stdout
    assert r.stderr.count("w" * 1000 + " end") >= 1


def test_home_given_before_the_subcommand(tmp_path, reference):
    """`hindsight --home H replay ...` as with every other subcommand; nothing
    in the environment or the working directory points at H."""
    script = make_project(tmp_path / "proj")
    home = tmp_path / "elsewhere" / "home"
    record(script, home)
    edit(script, OUTER_PROBE)
    env = {k: v for k, v in os.environ.items() if k != "HINDSIGHT_HOME"}
    r = subprocess.run(
        [*hindsight_cmd(), "--home", str(home), "replay", str(script), "-q", "--strict"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "restored from checkpoints" in r.stdout and " 0 restored" not in r.stdout, r.stdout
    assert not (tmp_path / "proj" / ".hindsight").exists()  # nothing created where H is not
    got, want = values(home, "weight_norm"), values(reference, "weight_norm")
    assert {c: v for c, v in got.items() if "weight_norm" in v} == {c: v for c, v in want.items() if "weight_norm" in v}


def test_inner_loop_probe_with_two_workers_matches_reference(recorded, reference):
    script, home = recorded
    edit(script, INNER_PROBE)
    r = replay(script, home, "-j", "2", "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "parallel replay of grad_norm on 2 worker(s)" in r.stdout
    got = values(home, "grad_norm", "loss")
    want = values(reference, "grad_norm", "loss")
    steps = {ctx: v for ctx, v in want.items() if "grad_norm" in v}
    assert len(steps) == 5 * 6
    for ctx, v in steps.items():
        assert got[ctx]["grad_norm"] == v["grad_norm"], ctx
        assert got[ctx]["loss"] == v["loss"], ctx  # record-time losses equal the reference's


# Asserts the plan: beside another test's load the cost rule may rightly execute an epoch instead.
@pytest.mark.serial
def test_missing_checkpoints_are_recomputed_from_the_nearest_earlier_one(tmp_path, reference):
    script = make_project(tmp_path / "proj")
    home = tmp_path / "proj" / ".hindsight"
    record(script, home, HINDSIGHT_CHECKPOINT_EVERY="2")  # epochs 0, 2, 4 checkpointed
    edit(script, OUTER_PROBE)
    r = replay(script, home, "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 restored from checkpoints, 12 inner-loop steps executed" in r.stdout  # epochs 1 and 3 rerun
    got, want = values(home, "weight_norm"), values(reference, "weight_norm")
    for ctx, v in want.items():
        if "weight_norm" in v:
            assert got[ctx]["weight_norm"] == v["weight_norm"], ctx


def test_a_run_that_took_no_checkpoint_says_so_and_replays_every_step(tmp_path, reference):
    script = make_project(tmp_path / "proj")
    home = tmp_path / "proj" / ".hindsight"
    # No period, and a bound no checkpoint fits in.
    record(script, home, HINDSIGHT_CHECKPOINT_EVERY="", HINDSIGHT_EPSILON="0.000001")
    shutil.rmtree(home / "store", ignore_errors=True)  # as where none was ever created
    edit(script, OUTER_PROBE)
    r = replay(script, home, "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "took no checkpoint" in r.stderr and "removed" not in r.stderr, r.stderr
    assert "0 restored from checkpoints, 30 inner-loop steps executed" in r.stdout, r.stdout
    got, want = values(home, "weight_norm"), values(reference, "weight_norm")
    assert {c: v for c, v in got.items() if v} == {c: v for c, v in want.items() if "weight_norm" in v}


def test_checkpoints_over_the_budget_are_thinned_and_replay_executes_between_them(tmp_path):
    script = make_project(tmp_path / "proj")
    home = tmp_path / "proj" / ".hindsight"
    reference = make_project(tmp_path / "ref", OUTER_PROBE)
    args = ["--epochs", "20", "--batches", "2"]
    record(reference, tmp_path / "ref" / ".hindsight", args)
    r = record(script, home, args, HINDSIGHT_CHECKPOINT_BUDGET="1k")
    assert "kept within 1.0 KiB (HINDSIGHT_CHECKPOINT_BUDGET), spread over the run" in r.stderr, r.stderr
    listed = subprocess.run(
        [*hindsight_cmd(), "ls", "--json"], env=env_for(home), capture_output=True, text=True, timeout=120
    )
    kept = sorted(int(c["meta"]["index"]) for c in json.loads(listed.stdout))
    # 20 checkpoints, each far over the budget: the fewest a budget keeps (8,
    # at a power-of-two stride over those left at each pass), and the newest.
    assert len(kept) <= 9 and kept[0] == 0 and kept[-1] == 19, (kept, r.stderr)
    edit(script, OUTER_PROBE)
    r = replay(script, home, "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    # Each epoch between two kept checkpoints is executed (how many restores
    # depends on the cost rule); every value is the reference's.
    assert "replayed 20 iteration(s)" in r.stdout, r.stdout
    got, want = values(home, "weight_norm"), values(tmp_path / "ref" / ".hindsight", "weight_norm")
    assert {c: v for c, v in got.items() if v} == {c: v for c, v in want.items() if "weight_norm" in v}


def test_a_probe_before_the_inner_loop_gets_the_state_the_previous_epoch_left(recorded, reference):
    script, home = recorded
    edit(script, PRE_PROBE)
    want = {ctx: v["start_norm"] for ctx, v in values(reference, "start_norm").items() if "start_norm" in v}
    assert len(want) == 5
    # One epoch alone: epoch 1 is restored and its code after the steps runs
    # first; epoch 1's own value is not kept, since epoch 0 was not replayed.
    r = replay(script, home, "--strict", "--where", "epoch == 2")
    assert r.returncode == 0, r.stdout + r.stderr
    got = {ctx: v["start_norm"] for ctx, v in values(home, "start_norm").items() if "start_norm" in v}
    assert got == {(("epoch", 2),): want[(("epoch", 2),)]}
    # Every epoch, with an inner probe too: two workers, each starting from a checkpoint.
    edit(script, INNER_PROBE)
    r = replay(script, home, "--strict", "-j", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    got = {ctx: v["start_norm"] for ctx, v in values(home, "start_norm").items() if "start_norm" in v}
    assert got == want


def test_a_replay_whose_worker_fails_prints_no_success_line(recorded):
    """Issue 43: stdout and the exit status agree: a worker that fails (a
    probe raising at epoch 4) ends the replay nonzero, and its last line
    says it failed and how far it got, never "replayed N iteration(s)"."""
    script, home = recorded
    edit(
        script,
        ("        sched.step()\n", '        sched.step()\n        hs.log("late", 1 / 0 if epoch == 4 else epoch)\n'),
    )
    r = replay(script, home)
    assert r.returncode == 1, r.stdout + r.stderr
    assert not re.search(r"replayed \d+ iteration", r.stdout), r.stdout
    assert re.search(
        r"replay of run \S+ FAILED \(1 of 1 worker\(s\) failed\).* reached \d+ of \d+ iteration", r.stdout
    ), r.stdout
    assert "ZeroDivisionError" in r.stderr


def test_where_limits_the_replayed_iterations(recorded):
    script, home = recorded
    edit(script, INNER_PROBE)
    r = replay(script, home, "--where", "epoch >= 3")
    assert r.returncode == 0, r.stderr
    got = values(home, "grad_norm")
    epochs = {ctx[0][1] for ctx, v in got.items() if "grad_norm" in v}
    assert epochs == {3, 4}


def test_a_script_changed_beyond_logging_replays_its_recorded_version_or_is_refused(recorded, reference):
    script, home = recorded
    edit(script, OUTER_PROBE, ('lr = hs.arg("lr", 1e-2)', 'lr = hs.arg("lr", 1e-2) * 2'))
    # The probe has a place in the recorded source: that version runs, not the changed lr.
    r = replay(script, home, "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "placed into its recorded source" in r.stdout
    got, want = values(home, "weight_norm"), values(reference, "weight_norm")
    assert {c: v for c, v in got.items() if "weight_norm" in v} == {c: v for c, v in want.items() if "weight_norm" in v}
    # A probe after the changed line has no place there: refused, with the differences.
    edit(script, ('lr = hs.arg("lr", 1e-2) * 2\n', 'lr = hs.arg("lr", 1e-2) * 2\nhs.log("lr", lr)\n'))
    r = replay(script, home)
    assert r.returncode == 1
    assert "cannot all be placed" in r.stderr and "* 2" in r.stderr and "--force" in r.stderr


def test_nondeterministic_script_is_caught_by_the_divergence_check(recorded):
    script, home = recorded
    # Forced past the source check: the model now trains on noisy inputs.
    edit(
        script,
        INNER_PROBE,
        (
            "loss = nn.functional.cross_entropy(net(x), y)",
            "loss = nn.functional.cross_entropy(net(x + 0.1 * torch.randn(x.shape)), y)",
        ),
    )
    # Fatal by default: exit 3, naming the first difference, and the probe's
    # values (computed on the wrong state) are not presented as results.
    r = replay(script, home, "--force")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "DIVERGENCE" in r.stderr and "first: loss at epoch=0, step=0" in r.stderr
    assert "discarded" in r.stderr
    # Nothing of it is kept: hs.dataframe says the name was never logged.
    gone = subprocess.run(
        [sys.executable, "-c", "import hindsight as hs; hs.dataframe('grad_norm')"],
        env=env_for(home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gone.returncode == 1 and "never logged 'grad_norm' (it logged: loss, val_acc)" in gone.stderr
    # Kept on request, marked: `hindsight logs` says so beside each value,
    # and hs.dataframe still does not show them as results.
    r = replay(script, home, "--force", "--allow-divergence")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DIVERGENCE" in r.stderr and "marked 'diverged'" in r.stderr
    logs = subprocess.run(
        [*hindsight_cmd(), "--home", str(home), "logs", "grad_norm"], capture_output=True, text=True, timeout=60
    )
    assert logs.returncode == 0 and "[diverged]" in logs.stdout, logs.stdout + logs.stderr
    assert not any(values(home, "grad_norm").values())


def test_unknown_run_and_missing_script_are_clear_errors(recorded):
    script, home = recorded
    r = replay(script, home, "--run", "nope")
    assert r.returncode == 1 and "nope" in r.stderr
    r = replay(script.parent / "missing.py", home)
    assert r.returncode == 1 and "missing.py" in r.stderr


def test_two_concurrent_recordings_in_one_project(tmp_path):
    script = make_project(tmp_path / "proj")
    home = tmp_path / "proj" / ".hindsight"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *ARGS, "--seed", str(s)],
            env=env_for(home),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=script.parent,
        )
        for s in (1, 2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    code = (
        "import json, hindsight as hs\n"
        "from hindsight import _native\n"
        "import os\n"
        "db = _native.LogDb(os.path.join(os.environ['HINDSIGHT_HOME'], 'logs.db'))\n"
        "out = []\n"
        "for r in db.runs():\n"
        "    out.append([r.status, json.loads(r.args_json)['seed'], len(db.logs(r.id, ['loss'])),"
        " len(db.logs(r.id, ['val_acc'])), len(db.iterations(r.id, 'epoch'))])\n"
        "print(json.dumps(sorted(out, key=lambda x: x[1])))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env_for(home), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [["completed", 1, 30, 5, 5], ["completed", 2, 30, 5, 5]]
    # Argument columns tell the runs apart in one frame.
    code = (
        "import json, hindsight as hs\n"
        "from hindsight import _native\n"
        "import os\n"
        "db = _native.LogDb(os.path.join(os.environ['HINDSIGHT_HOME'], 'logs.db'))\n"
        "df = hs.dataframe('val_acc', run=[r.id for r in db.runs()], args=True)\n"
        "print(json.dumps(sorted(df.groupby('seed')['val_acc'].count().items())))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env_for(home), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [[1, 5], [2, 5]]
    r = subprocess.run([*hindsight_cmd(), "verify", str(home / "store")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ("epoch >=", "not an expression"),
        ("epoch in 'abc'", "not a number"),
        ("epoch // 0 == 1", "division"),
        ("'a' * 20000000000 == epoch", "not a number"),
        ("[0] * 10**10 == epoch", "no arithmetic on lists"),
        ("__import__('os')", "only comparisons"),
        ("(" * 3000 + "epoch" + ")" * 3000 + " > 0", "characters"),  # was a RecursionError
    ],
)
def test_bad_where_is_a_one_line_error(recorded: tuple[Path, Path], where: str, says: str) -> None:
    script, home = recorded
    edit(script, INNER_PROBE)
    r = replay(script, home, "--where", where)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and says in r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr


def test_a_worker_count_out_of_range_is_a_usage_error(recorded: tuple[Path, Path]) -> None:
    script, home = recorded
    edit(script, INNER_PROBE)
    for n in ("0", str(10**30), "many"):
        r = replay(script, home, "-j", n)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr and "-j" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("content", "says"),
    [(b"for x in range(3)\n    pass\n", "syntax error"), (b"x = '\xff\xfe'\n", "not UTF-8")],
)
def test_a_script_that_is_not_python_is_a_clear_error(recorded: tuple[Path, Path], content: bytes, says: str) -> None:
    script, home = recorded
    script.write_bytes(content)
    r = replay(script, home)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert says in r.stderr and script.name in r.stderr


def test_a_later_exact_replay_is_not_blamed_for_an_earlier_forced_one(recorded: tuple[Path, Path]) -> None:
    script, home = recorded
    noisy = (
        "loss = nn.functional.cross_entropy(net(x), y)",
        "loss = nn.functional.cross_entropy(net(x + 0.1 * torch.randn(x.shape)), y)",
    )
    edit(script, INNER_PROBE, noisy)
    # Diverges; its rows are kept (marked) on request.
    assert replay(script, home, "--force", "--allow-divergence").returncode == 0
    edit(script, (noisy[1], noisy[0]))  # back to the recorded computation
    r = replay(script, home, "--where", "epoch == 0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DIVERGENCE" not in r.stderr
    # The exact values replace the diverged ones where it replayed, and only there.
    got = {ctx: v for ctx, v in values(home, "grad_norm").items() if v}
    assert got and all(dict(ctx)["epoch"] == 0 for ctx in got), got


def test_rm_run_deletes_the_run_its_logs_and_its_checkpoints(tmp_path: Path) -> None:
    script = make_project(tmp_path / "proj")
    home = tmp_path / "proj" / ".hindsight"
    record(script, home)
    record(script, home, HINDSIGHT_RESUME="0")
    record(script, home, HINDSIGHT_RESUME="0")  # a third run, kept
    runs = json.loads(
        subprocess.run([*hindsight_cmd(), "--home", str(home), "runs", "--json"], capture_output=True, text=True).stdout
    )
    gone2, gone, kept = runs[2]["id"], runs[1]["id"], runs[0]["id"]  # newest first
    ls = subprocess.run([*hindsight_cmd(), "ls", str(home / "store")], capture_output=True, text=True).stdout
    assert gone in ls and gone2 in ls and kept in ls
    # The README's form: several runs after one --run.
    r = subprocess.run(
        [*hindsight_cmd(), "--home", str(home), "rm", "--run", gone, gone2], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert f"removed run {gone} and 5 checkpoints" in r.stdout
    assert f"removed run {gone2} and 5 checkpoints" in r.stdout
    # While a replay reads a run (it holds the run shared, as `hindsight
    # replay` does), neither the run nor one of its checkpoints is removed:
    # one line each, exit 1, nothing gone (issue 42, item 8).
    ls_before = subprocess.run([*hindsight_cmd(), "ls", str(home / "store")], capture_output=True, text=True).stdout
    one = next(line.split()[0] for line in ls_before.splitlines() if line.startswith(kept))
    from hindsight import _native

    replaying = _native.RunLease.share(home, kept)
    try:
        for args in (["rm", "--run", kept], ["rm", one]):
            r = subprocess.run([*hindsight_cmd(), "--home", str(home), *args], capture_output=True, text=True)
            assert r.returncode == 1, (args, r.stdout, r.stderr)
            assert r.stderr.count("\n") == 1 and "being replayed" in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        replaying.release()
    assert (
        subprocess.run([*hindsight_cmd(), "ls", str(home / "store")], capture_output=True, text=True).stdout
        == ls_before
    )
    after = json.loads(
        subprocess.run([*hindsight_cmd(), "--home", str(home), "runs", "--json"], capture_output=True, text=True).stdout
    )
    assert [x["id"] for x in after] == [kept]
    ls = subprocess.run([*hindsight_cmd(), "ls", str(home / "store")], capture_output=True, text=True).stdout
    assert gone not in ls and gone2 not in ls and kept in ls
    r = subprocess.run([*hindsight_cmd(), "--home", str(home), "rm", "--run", gone], capture_output=True, text=True)
    assert r.returncode == 1 and gone in r.stderr  # no such run any more


REPEATED = """\
import torch
import hindsight as hs

torch.manual_seed(0)
w = torch.nn.Parameter(torch.ones(4))
opt = torch.optim.SGD([w], lr=0.1)
with hs.checkpointing(w=w, opt=opt):
    for epoch in hs.loop("epoch", range(3)):
        for step in hs.loop("step", range(4)):
            opt.zero_grad()
            (w * (step + 1)).sum().backward()
            opt.step()
        for k in range(3):  # a validation loop without hs.loop: one context
            hs.log("val", float(w.sum()) + k)
"""


def test_a_name_logged_repeatedly_in_one_context_keeps_every_value(tmp_path: Path) -> None:
    script = tmp_path / "rep.py"
    script.write_text(REPEATED)
    home = tmp_path / ".hindsight"
    r = subprocess.run([sys.executable, str(script)], env=env_for(home), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    code = (
        "import sys, hindsight as hs\n"
        "df = hs.dataframe(*sys.argv[1:])\n"
        "print(df[['epoch', 'rep', *sys.argv[1:]]].to_json(orient='values'))\n"
    )

    def table(*names: str) -> list[list[object]]:
        out = subprocess.run(
            [sys.executable, "-c", code, *names],
            env=env_for(home),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    rows = table("val")
    assert [(e, rep) for e, rep, _ in rows] == [(e, k) for e in range(3) for k in range(3)]
    for e, k, val in rows:
        assert val == rows[3 * e][2] + k  # every value, in the order logged
    # A probe added in the same validation loop is replayed occurrence by occurrence.
    script.write_text(
        REPEATED.replace('            hs.log("val"', '            hs.log("probe", k * 10)\n            hs.log("val"')
    )
    r = replay(script, home, "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [(e, k, p) for e, k, _, p in table("val", "probe")] == [(e, k, k * 10) for e in range(3) for k in range(3)]


COUNTED = """\
import itertools
import torch
import hindsight as hs

torch.manual_seed(0)
w = torch.nn.Parameter(torch.ones(4))
opt = torch.optim.SGD([w], lr=0.01)
max_iters = hs.arg("max_iters", 10)
with hs.checkpointing(w=w, opt=opt):
    for it in hs.loop("iter", itertools.count()):  # one step per iteration, no epochs
        x = torch.randn(4, generator=torch.Generator().manual_seed(it))
        loss = ((w * x).sum() - 1) ** 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        hs.log("loss", loss.item())
        if it >= max_iters:
            break
"""
COUNTED_PROBE = (
    '        hs.log("loss", loss.item())\n',
    '        hs.log("loss", loss.item())\n        hs.log("w_sum", float(w.detach().sum()))\n',
)


def test_an_iteration_loop_with_break_replays_every_iteration_including_the_last(tmp_path: Path) -> None:
    ref = tmp_path / "ref" / "it.py"
    ref.parent.mkdir()
    ref.write_text(COUNTED.replace(*COUNTED_PROBE))
    script = tmp_path / "proj" / "it.py"
    script.parent.mkdir()
    script.write_text(COUNTED)
    for s in (ref, script):
        r = subprocess.run(
            [sys.executable, str(s)],
            # One thread: replay workers run with the recording's, two fit this machine.
            env=env_for(s.parent / ".hindsight", OMP_NUM_THREADS="1"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
    want = {c: v["w_sum"] for c, v in values(ref.parent / ".hindsight", "w_sum").items() if "w_sum" in v}
    assert len(want) == 11  # iterations 0..10, the last one ended by `break`
    edit(script, COUNTED_PROBE)
    home = script.parent / ".hindsight"
    r = replay(script, home, "--strict", "--where", "iter >= 8")
    assert r.returncode == 0, r.stdout + r.stderr
    got = {c: v["w_sum"] for c, v in values(home, "w_sum").items() if "w_sum" in v}
    assert got == {c: v for c, v in want.items() if c[0][1] >= 8}
    r = replay(script, home, "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    assert {c: v["w_sum"] for c, v in values(home, "w_sum").items() if "w_sum" in v} == want
    # A probe in the body of one-step iterations needs every body run: they
    # split over the workers, the second starting from a checkpoint.
    r = replay(script, home, "-j", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "parallel replay of w_sum on 2 worker(s)" in r.stdout, r.stdout
    executed = re.search(r"(\d+) iteration\(s\) without an inner loop executed", r.stdout)
    assert executed is not None and int(executed.group(1)) >= 11, r.stdout  # 0..10, some twice
    assert {c: v["w_sum"] for c, v in values(home, "w_sum").items() if "w_sum" in v} == want


VERSION_2 = (
    "sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)",
    "sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)",
)
VERSION_3 = ('lr = hs.arg("lr", 1e-2)', 'lr = hs.arg("lr", 5e-3)')


def test_new_probes_replay_into_runs_of_three_code_versions(tmp_path: Path) -> None:
    versions = [(), (VERSION_2,), (VERSION_2, VERSION_3)]
    # What each version logs when the probe is there from the start.
    want = []
    for k, edits in enumerate(versions):
        ref = make_project(tmp_path / f"ref{k}", *edits, OUTER_PROBE)
        record(ref, ref.parent / ".hindsight")
        want.append(
            {
                c: v["weight_norm"]
                for c, v in values(ref.parent / ".hindsight", "weight_norm").items()
                if "weight_norm" in v
            }
        )
    assert want[0] != want[1] != want[2]
    # One project, one script, edited between three recordings.
    home = tmp_path / "proj" / ".hindsight"
    for edits in versions:
        script = make_project(tmp_path / "proj", *edits)
        record(script, home)
    make_project(tmp_path / "proj", *versions[-1], OUTER_PROBE)  # the latest version, plus a probe
    r = replay(script, home, "--runs", "all", "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("placed into its recorded source") == 2, r.stdout  # the two older versions
    code = (
        "import json, hindsight as hs\n"
        "db = hs._query._db()\n"
        "print(json.dumps([[[v.ctx, json.loads(v.value_json)] for v in db.values(r.id, ['weight_norm'])]"
        " for r in sorted(db.runs(), key=lambda r: r.started_ms)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env_for(home), capture_output=True, text=True, timeout=60, cwd=script.parent
    )
    assert out.returncode == 0, out.stderr
    got = [{tuple(map(tuple, ctx)): v for ctx, v in run} for run in json.loads(out.stdout)]
    assert len(got) == 3
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-9)  # `values` reads through a JSON round with 10 digits
    assert not list(script.parent.glob(".hindsight-replay-*"))  # the placed copies are removed
    # A statement whose place the older versions lack is refused for them, with the reason.
    make_project(
        tmp_path / "proj",
        *versions[-1],
        ("        sched.step()\n", "        sched.step()\n        extra = 1\n        hs.log('e', extra)\n"),
    )
    r = replay(script, home, "--runs", "all")
    assert r.returncode == 1
    assert "cannot all be placed" in r.stderr


def test_a_guarded_probe_with_a_helper_variable_and_an_import_matches_the_reference(recorded, reference):
    """Added code that only observes (an import, an `if` guard, a helper
    variable) replays like a bare hs.log: the training code is unchanged."""
    script, home = recorded
    edit(
        script,
        ("import torch\n", "import torch\nimport math\n"),
        (
            "            opt.step()\n",
            "            if epoch % 2 == 0:\n"
            "                total = sum(p.grad.norm().item() ** 2 for p in net.parameters())\n"
            '                hs.log("grad_norm", math.sqrt(total))\n'
            "            opt.step()\n",
        ),
    )
    r = replay(script, home, "-j", "2", "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    got = {c: v for c, v in values(home, "grad_norm").items() if v}
    want = {c: v for c, v in values(reference, "grad_norm").items() if v and dict(c)["epoch"] % 2 == 0}
    assert len(want) == 3 * 6
    assert got.keys() == want.keys()
    for ctx, v in want.items():
        assert got[ctx]["grad_norm"] == pytest.approx(v["grad_norm"], rel=1e-12), ctx


def test_added_code_that_writes_training_state_is_refused_naming_the_statement(recorded):
    script, home = recorded
    edit(script, ("            opt.step()\n", "            opt.step()\n            extra = net[0].weight.mul_(1.0)\n"))
    r = replay(script, home)
    assert r.returncode == 1
    assert "extra = net[0].weight.mul_(1.0): calls net[0].weight.mul_(), an in-place operation" in r.stderr


def test_runs_share_one_worker_budget(tmp_path: Path) -> None:
    """`--runs all -j 2` over two runs of an inner-loop probe: four workers,
    never more than two at once, each run's values its own reference's."""
    probe = (
        "            opt.step()\n",
        '            hs.log("pid", os.getpid())\n'
        '            hs.log("grad_norm", sum(p.grad.norm().item() ** 2 for p in net.parameters()) ** 0.5)\n'
        "            opt.step()\n",
    )
    imports = ("import torch\n", "import os\nimport torch\n")
    want = []
    for seed in ("0", "1"):
        ref = make_project(tmp_path / f"ref{seed}", imports, probe)
        subprocess.run(
            [sys.executable, str(ref), *ARGS, "--seed", seed],
            env=env_for(ref.parent / ".hindsight"),
            capture_output=True,
            timeout=300,
            cwd=ref.parent,
            check=True,
        )
        want.append({c: v["grad_norm"] for c, v in values(ref.parent / ".hindsight", "grad_norm").items() if v})
    assert want[0] != want[1]
    script = make_project(tmp_path / "proj")
    home = tmp_path / "proj" / ".hindsight"
    for seed in ("0", "1"):
        r = subprocess.run(
            [sys.executable, str(script), *ARGS, "--seed", seed],
            env=env_for(home),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=script.parent,
        )
        assert r.returncode == 0, r.stderr
    edit(script, imports, probe)
    r = replay(script, home, "--runs", "all", "-j", "2", "--strict")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("parallel replay of grad_norm, pid on 2 worker(s)") == 2, r.stdout
    from hindsight import _native

    db = _native.LogDb(str(home / "logs.db"))
    runs = sorted(db.runs(), key=lambda r: r.started_ms)
    spans: dict[int, list[int]] = {}
    for run, w in zip(runs, want, strict=True):
        got = {tuple(v.ctx): json.loads(v.value_json) for v in db.values(run.id, ["grad_norm"])}
        assert got == pytest.approx({tuple(map(tuple, c)): x for c, x in w.items()}, rel=1e-9)
        for rec in db.logs(run.id, ["pid"]):
            span = spans.setdefault(int(rec.value_json), [rec.created_ms, rec.created_ms])
            span[0], span[1] = min(span[0], rec.created_ms), max(span[1], rec.created_ms)
    assert len(spans) == 4  # two workers per run
    # At no instant were more than two workers logging.
    for t in {t for s in spans.values() for t in s}:
        assert sum(1 for a, b in spans.values() if a <= t <= b) <= 2, spans


def test_a_probe_whose_line_never_runs_is_named_not_passed_silently(tmp_path: Path) -> None:
    script = tmp_path / "rep.py"
    script.write_text(REPEATED)
    home = tmp_path / ".hindsight"
    r = subprocess.run([sys.executable, str(script)], env=env_for(home), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    script.write_text(
        REPEATED.replace(
            "            opt.step()\n",
            "            opt.step()\n            if step > 9:\n                hs.log('never', step)\n",
        )
    )
    r = replay(script, home)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the replay produced no value of 'never'" in r.stderr, r.stderr


def test_a_copied_project_reads_its_own_store_and_a_moved_one_still_replays(tmp_path: Path, reference: Path) -> None:
    """Issue 22: run rows hold absolute paths, so `cp -r proj proj2` replayed
    from proj's checkpoints, and `mv proj proj3` found no recorded run."""
    script, _ = record_project(tmp_path / "proj")

    def only(home: Path, name: str) -> dict[tuple, object]:
        return {ctx: v[name] for ctx, v in values(home, name).items() if name in v}

    want = only(reference, "weight_norm")
    assert len(want) == 5
    shutil.copytree(tmp_path / "proj", tmp_path / "proj2")
    # The original's checkpoints go: the copy must not need them.
    shutil.rmtree(tmp_path / "proj" / ".hindsight" / "store")
    copy = tmp_path / "proj2" / "train.py"
    edit(copy, OUTER_PROBE)
    r = replay(copy, tmp_path / "proj2" / ".hindsight")
    assert r.returncode == 0, r.stdout + r.stderr
    assert only(tmp_path / "proj2" / ".hindsight", "weight_norm") == want

    # Moved: found by its path in the project, replayed where it is now.
    (tmp_path / "proj2").rename(tmp_path / "proj3")
    moved = tmp_path / "proj3" / "train.py"
    edit(moved, INNER_PROBE)
    r = replay(moved, tmp_path / "proj3" / ".hindsight", "-j", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert only(tmp_path / "proj3" / ".hindsight", "grad_norm") == only(reference, "grad_norm")

    # The original, whose store is gone: said once, naming it, and every
    # iteration re-executed (issue 22: it used to say nothing).
    edit(script, OUTER_PROBE)
    r = replay(script, tmp_path / "proj" / ".hindsight")
    assert r.returncode == 0, r.stdout + r.stderr
    gone = f"its checkpoint store is not at {tmp_path / 'proj' / '.hindsight' / 'store'}"
    assert r.stderr.count(gone) == 1, r.stderr
    assert only(tmp_path / "proj" / ".hindsight", "weight_norm") == want


def test_a_checkpoint_recorded_before_the_rng_state_was_packed_still_checks_equal(tmp_path):
    """Recordings made before Python's RNG state was kept as bytes hold its
    625 words one by one. A replay worker's state check against such a
    checkpoint compares its live state in that form: the same state is
    equal (not a divergence), and a different one still differs."""
    import random

    import hindsight as hs
    from hindsight._state import rng_as_recorded, rng_state

    random.seed(7)
    version, words, gauss = random.getstate()
    store = hs.Store(tmp_path / "s")
    store.save("old", {"rng": {"python": (version, words, gauss)}, "n": 1}).wait()  # as rng_state kept it
    live = {"rng": {"python": rng_state()["python"]}, "n": 1}
    assert isinstance(live["rng"]["python"][1], bytes)
    entries = store.info("old")["entries"]
    assert store.check_state("old", live).first is not None  # the representations differ
    assert store.check_state("old", rng_as_recorded(live, entries)).first is None
    random.random()
    moved = {"rng": {"python": rng_state()["python"]}, "n": 1}
    first = store.check_state("old", rng_as_recorded(moved, entries)).first
    assert first is not None and first.path.startswith("rng/python"), first
    # A checkpoint in today's form is compared as it is.
    store.save("new", live).wait()
    assert rng_as_recorded(live, store.info("new")["entries"]) is live
    assert store.check_state("new", live).first is None

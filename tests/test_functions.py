"""Hindsight logging on a script shaped like pytorch/examples' mnist/main.py
(examples/functions_train.py): the step loop inside `train()`, evaluation in
`test()`, the epoch loop in `main()`. Probes added anywhere replay to the
values of a run that had them from the start, and epoch-level ones replay
from checkpoints without running a step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, hindsight_cmd

NORM = "sum(p.detach().norm().item() ** 2 for p in model.parameters()) ** 0.5"
IN_MAIN = (
    '            hs.log("accuracy", accuracy)\n',
    f'            hs.log("accuracy", accuracy)\n            hs.log("main_norm", {NORM})\n',
)
IN_TEST = ("    model.eval()\n", f'    model.eval()\n    hs.log("test_norm", {NORM})\n')
BEFORE_STEPS = ("    model.train()\n", f'    model.train()\n    hs.log("start_norm", {NORM})\n')
IN_STEPS = ("        optimizer.step()\n", f'        optimizer.step()\n        hs.log("step_norm", {NORM})\n')
PROBES = ("main_norm", "test_norm", "start_norm", "step_norm")


def project(root: Path, *edits: tuple[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    src = (REPO / "examples" / "functions_train.py").read_text()
    for old, new in edits:
        assert old in src, old
        src = src.replace(old, new, 1)
    (root / "train.py").write_text(src)
    return root / "train.py"


def env_for(home: Path) -> dict[str, str]:
    # One torch thread everywhere: -j 2 workers on 2 cores get one each, and
    # the values then agree to the last bit with the recording's.
    return {**os.environ, "HINDSIGHT_HOME": str(home), "HINDSIGHT_CHECKPOINT_EVERY": "1", "OMP_NUM_THREADS": "1"}


def record(script: Path) -> Path:
    home = script.parent / ".hindsight"
    r = subprocess.run(
        [sys.executable, str(script)], env=env_for(home), capture_output=True, text=True, timeout=300, cwd=script.parent
    )
    assert r.returncode == 0, r.stderr
    return home


def replay(script: Path, *extra: str) -> str:
    r = subprocess.run(
        [*hindsight_cmd(), "replay", str(script), "-q", "--strict", *extra],
        env=env_for(script.parent / ".hindsight"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=script.parent,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def logged(home: Path, name: str) -> dict[tuple[tuple[str, int], ...], float]:
    """{context: value} of `name` in the latest run (both phases)."""
    code = (
        "import json, sys, hindsight as hs\n"
        "print(json.dumps([[v.ctx, v.rep, v.value_json] for v in hs._query._db().values("
        "hs._query._db().runs(1)[0].id, [sys.argv[1]])]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, name], env=env_for(home), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return {(tuple(map(tuple, ctx)), rep): json.loads(v) for ctx, rep, v in json.loads(r.stdout)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    script = project(tmp_path_factory.mktemp("reference"), IN_MAIN, IN_TEST, BEFORE_STEPS, IN_STEPS)
    home = record(script)
    values = {name: logged(home, name) for name in PROBES}
    assert len(values["main_norm"]) == 4 and len(values["step_norm"]) == 4 * 12
    return values


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    script = project(tmp_path / "proj")
    record(script)
    return script


# The replay prices a restore against the step it saves from measured times:
# beside another test's load it may rightly execute.
@pytest.mark.serial
def test_epoch_level_probes_in_main_and_in_a_helper_replay_without_training(recorded, reference):
    script = recorded
    project(script.parent, IN_MAIN, IN_TEST)
    out = replay(script)
    assert "partial replay" in out and "0 inner-loop steps executed" in out, out
    home = script.parent / ".hindsight"
    for name in ("main_norm", "test_norm"):
        assert logged(home, name) == reference[name], name


def test_a_probe_before_the_steps_in_train_gets_the_state_the_previous_epoch_left(recorded, reference):
    script = recorded
    project(script.parent, BEFORE_STEPS)
    replay(script, "--where", "epoch == 3")  # the iterated value: position 2
    got = logged(script.parent / ".hindsight", "start_norm")
    want = {k: v for k, v in reference["start_norm"].items() if k[0] == (("epoch", 2),)}
    assert got == want and len(got) == 1


def test_a_probe_inside_the_steps_of_train_replays_in_parallel(recorded, reference):
    script = recorded
    project(script.parent, IN_STEPS)
    out = replay(script, "-j", "2")
    assert "parallel replay" in out, out
    assert logged(script.parent / ".hindsight", "step_norm") == reference["step_norm"]


def test_the_epoch_is_the_value_iterated_over_in_where_and_the_dataframe(recorded, reference):
    script = recorded
    home = script.parent / ".hindsight"
    project(script.parent, IN_MAIN)
    replay(script, "--where", "epoch == 3")  # range(1, epochs + 1): the third epoch, position 2
    assert logged(home, "main_norm") == {k: v for k, v in reference["main_norm"].items() if k[0] == (("epoch", 2),)}
    code = "import hindsight as hs\nprint(hs.dataframe('accuracy')[['epoch', 'epoch_idx']].to_json(orient='values'))"
    r = subprocess.run([sys.executable, "-c", code], env=env_for(home), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [[1, 0], [2, 1], [3, 2], [4, 3]]


HANDS_FREE = (
    "    with hs.checkpointing(model=model, optimizer=optimizer, scheduler=scheduler):\n",
    "    with hs.checkpointing():\n",
)


# Asserts the plan (every epoch restored): the cost rule, as above.
@pytest.mark.serial
def test_hands_free_checkpointing_finds_the_objects_and_explains_them(tmp_path, reference):
    script = project(tmp_path / "proj", HANDS_FREE)
    r = subprocess.run(
        [*hindsight_cmd(), "record", "--explain", str(script)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    for line in ("model: __main__.Net (read by the loop", "optimizer: torch.optim.adadelta.Adadelta", "scheduler: "):
        assert line in r.stdout, r.stdout
    assert "accuracy (line" in r.stdout  # a loop variable
    assert not (script.parent / ".hindsight").exists()  # --explain records nothing
    record(script)
    project(script.parent, HANDS_FREE, IN_MAIN)
    out = replay(script)
    assert "4 restored from checkpoints, 0 inner-loop steps executed" in out, out
    assert logged(script.parent / ".hindsight", "main_norm") == reference["main_norm"]

"""One owner per rule: a rule asked from every front end gives the same
answer. Each front end (an `hs.loop` recording, the Lightning callback and
the Trainer callback given no store, with or without a run in the process)
asks core (`runs::store_choice`) which store a run writes to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

STORE_SCRIPT = """
import json
import torch
import hindsight as hs
from hindsight.lightning import HindsightCheckpoint
from hindsight.transformers import HindsightCallback

got = {"lightning, before any run": str(HindsightCheckpoint().store.path)}
net = torch.nn.Linear(1, 1)
with hs.checkpointing(model=net):
    for epoch in hs.loop("epoch", range(1)):
        pass
from hindsight import _run
got["hs.loop"] = str(_run._RUN.store.path)
got["lightning, in the run"] = str(HindsightCheckpoint().store.path)
got["trainer callback"] = str(HindsightCallback().store.path)
print(json.dumps(got))
"""


@pytest.mark.parametrize("where", ["home", "env"])
def test_every_front_end_given_no_store_writes_to_the_same_one(tmp_path: Path, where: str) -> None:
    (tmp_path / "train.py").write_text(STORE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HINDSIGHT_")}
    want = tmp_path / ".hindsight" / "store"
    if where == "env":
        want = tmp_path / "elsewhere" / "store"
        env["HINDSIGHT_STORE"] = str(want)
    r = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert set(got.values()) == {str(want)}, got


ARGS_SCRIPT = """
import json, os, sys
os.environ.setdefault("KERAS_BACKEND", "torch")
from hindsight.errors import HindsightError
from hindsight.keras import HindsightCallback as KerasCallback
from hindsight.lightning import HindsightCheckpoint
from hindsight.transformers import HindsightCallback

kwargs = json.loads(sys.argv[1])
got = {}
for front, cls in (("lightning", HindsightCheckpoint), ("trainer", HindsightCallback), ("keras", KerasCallback)):
    try:
        cls(store="store", **kwargs)
        got[front] = "accepted"
    except HindsightError as e:
        # The rule's answer, without the front end's own name.
        got[front] = type(e).__name__ + ": " + str(e).split("(", 1)[-1]
print(json.dumps(got))
"""


@pytest.mark.parametrize(
    "kwargs",
    [
        {"every_n_epochs": True},
        {"every_n_epochs": 0},
        {"every_n_train_steps": -2},
        {"keep_best": 2},
        {"keep_best": 2, "monitor": "val_loss", "mode": "median"},
        {"keep_last": 0},
        {"exit_code": 0},
        {"exit_code": 256},
        {"prefix": "a/b"},
        {"every_n_epochs": 2, "keep_last": 3, "keep_best": 1, "monitor": "loss", "exit_code": 85},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_every_framework_callback_checks_its_arguments_by_one_rule(tmp_path: Path, kwargs: dict[str, object]) -> None:
    """Lightning's checkpoint callback, the Trainer callback and the Keras
    callback take the same period, retention, exit-code and prefix
    arguments: each set is accepted by all three or refused by all three
    with the same reason."""
    r = subprocess.run(
        [sys.executable, "-c", ARGS_SCRIPT, json.dumps(kwargs)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert len(set(got.values())) == 1, got
    assert (got["keras"] == "accepted") == (kwargs.get("exit_code") == 85), got

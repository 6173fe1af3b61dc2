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

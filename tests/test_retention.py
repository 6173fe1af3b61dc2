"""The retention a recording applies when its user chose none (core's
`Retention::default_for_loop`): an iteration loop (over `itertools.count()`,
as nanoGPT's `while True`) keeps a bounded set of checkpoints spread over
the run, and a replay still answers a probe exactly from what is left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hindsight import _native

from conftest import hindsight_cmd

ITERS = 300

SCRIPT = f"""\
import itertools
import torch
import hindsight as hs

torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(64))
opt = torch.optim.SGD([w], lr=0.01)
with hs.checkpointing(model=torch.nn.ParameterList([w]), optimizer=opt):
    for it in hs.loop("iter", itertools.count()):
        if it == {ITERS}:
            break
        for micro in hs.loop("micro", range(2)):
            loss = (w - torch.randn(64)).square().mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
        hs.log("loss", loss.item())
"""


def _run(cmd: list[str], cwd: Path, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, "HINDSIGHT_HOME": str(home), **env}
    e.pop("HINDSIGHT_EPSILON", None)
    r = subprocess.run(cmd, cwd=cwd, env=e, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_an_iteration_loop_keeps_a_bounded_spread_of_checkpoints_and_replays_exactly(tmp_path: Path) -> None:
    spread = _native.default_retention_spread(None)
    assert spread is not None and ITERS > spread
    assert _native.default_retention_spread(100) is None, "an epoch loop keeps every checkpoint"
    ref, proj = tmp_path / "ref", tmp_path / "proj"
    for d in (ref, proj):
        d.mkdir()
    probe = '        hs.log("w_norm", w.detach().norm().item())\n'
    (ref / "train.py").write_text(SCRIPT + probe)
    (proj / "train.py").write_text(SCRIPT)
    # Every iteration checkpointed: the most a store can hold without retention.
    _run([sys.executable, "train.py"], ref, ref / ".hindsight", HINDSIGHT_CHECKPOINT_EVERY="1")
    _run([sys.executable, "train.py"], proj, proj / ".hindsight", HINDSIGHT_CHECKPOINT_EVERY="1")

    db = _native.LogDb(str(proj / ".hindsight" / "logs.db"))
    run_id = db.latest_run().id
    store = proj / ".hindsight" / "store" / "manifests"
    kept = sorted(p.name for p in store.iterdir() if p.name.startswith(run_id))
    assert len(kept) <= spread + 1, f"{len(kept)} checkpoints kept of {ITERS}"
    assert any(".iter-000000." in k or k.endswith(".iter-000000.hsm") for k in kept), kept[:3]

    (proj / "train.py").write_text(SCRIPT + probe)
    r = subprocess.run(
        [*hindsight_cmd(), "replay", "train.py", "-q"],
        cwd=proj,
        env={**os.environ, "HINDSIGHT_HOME": str(proj / ".hindsight")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr

    def values(home: Path) -> dict[int, str]:
        d = _native.LogDb(str(home / "logs.db"))
        rid = d.latest_run().id
        return {rec.ctx[0][1]: rec.value_json for rec in d.logs(rid, ["w_norm"])}

    want, got = values(ref / ".hindsight"), values(proj / ".hindsight")
    assert len(want) == ITERS
    assert got == want

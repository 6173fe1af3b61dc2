"""One owner per rule: a rule asked from every front end gives the same
answer. Each front end (an `hs.loop` recording, the Lightning callback and
the Trainer callback given no store, with or without a run in the process)
asks core (`runs::store_choice`) which store a run writes to."""

from __future__ import annotations

import json
import os
import re
import shutil
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


BUDGET_SCRIPT = """
import os, sys
os.environ.setdefault("KERAS_BACKEND", "torch")
import torch
import hindsight as hs

EPOCHS = 20
front = sys.argv[1]
torch.manual_seed(0)
x = torch.randn(8, 4)
y = x.sum(1, keepdim=True)
if front == "lightning":
    import lightning.pytorch as pl
    from hindsight.lightning import HindsightCheckpoint

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, i):
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    trainer = pl.Trainer(max_epochs=EPOCHS, callbacks=[HindsightCheckpoint()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(), data)
elif front == "trainer":
    from transformers import Trainer, TrainingArguments
    from hindsight.transformers import HindsightCallback

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.mse_loss(self.layer(x), labels)}

    rows = [{"x": x[i], "labels": y[i]} for i in range(8)]
    args = TrainingArguments(output_dir="out", num_train_epochs=EPOCHS, per_device_train_batch_size=8, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, logging_strategy="no")
    Trainer(model=Net(), args=args, train_dataset=rows, callbacks=[HindsightCallback()]).train()
else:
    import keras
    from hindsight.keras import HindsightCallback

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x.numpy(), y.numpy(), epochs=EPOCHS, batch_size=8, verbose=0, callbacks=[HindsightCallback()])
import json
print(json.dumps(sorted(hs.Store(".hindsight/store").list())))
"""


@pytest.mark.parametrize("front", ["lightning", "trainer", "keras"])
def test_every_framework_fit_keeps_its_checkpoints_within_the_store_budget(tmp_path: Path, front: str) -> None:
    """A fit's interim checkpoints are bounded by $HINDSIGHT_CHECKPOINT_BUDGET
    as an hs.loop run's are (core `checkpoint_size`): over budget, 20 epoch
    checkpoints are thinned to a spread of at most 8 (the floor), the last
    one among them; within the default budget all 20 are kept."""
    if front == "keras":
        os.environ.setdefault("KERAS_BACKEND", "torch")
        pytest.importorskip("keras")
    kept = {}
    for budget in ("16GiB", "100B"):
        cwd = tmp_path / budget
        cwd.mkdir()
        (cwd / "train.py").write_text(BUDGET_SCRIPT)
        env = {k: v for k, v in os.environ.items() if not k.startswith("HINDSIGHT_")}
        env.update(HINDSIGHT_HOME=str(cwd / ".hindsight"), HINDSIGHT_CHECKPOINT_BUDGET=budget, OMP_NUM_THREADS="1")
        r = subprocess.run(
            [sys.executable, "train.py", front], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr[-3000:]
        names = json.loads(r.stdout.splitlines()[-1])
        # The epochs kept (the names hold a run id under the Trainer and Keras).
        kept[budget] = [n.rsplit(".", 1)[-1] for n in names if not n.endswith(".end")]
    assert len(kept["16GiB"]) == 20, kept
    assert 2 <= len(kept["100B"]) <= 8, kept
    assert set(kept["100B"]) < set(kept["16GiB"]), kept
    assert kept["100B"][-1] == kept["16GiB"][-1], kept  # the newest is kept: a resume loses nothing


WALK_SCRIPT = """
import os, signal, torch, hindsight as hs
torch.manual_seed(0)
net = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
with hs.checkpointing(model=net, optimizer=opt):
    for epoch in hs.loop("epoch", range(4)):
        loss = net(torch.ones(2, 4)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if epoch == 2 and os.environ.get("STOP"):
            os.kill(os.getpid(), signal.SIGTERM)
print(repr(float(net.weight.sum())))
"""


def damage(store: Path, name: str) -> None:
    """Flip a byte of every chunk checkpoint ``name`` holds and no other does."""

    def chunks(n: str) -> set[str]:
        raw = (store / "manifests" / f"{n}.hsm").read_bytes()
        return {m.decode() for m in re.findall(rb'"(?:id|own)":"([0-9a-f]{64})"', raw)}

    others = set().union(*(chunks(p.stem) for p in (store / "manifests").glob("*.hsm") if p.stem != name))
    files = [f for i in chunks(name) - others if (f := store / "chunks" / i[:2] / i[2:]).exists()]
    assert files, name
    for f in files:
        data = f.read_bytes()
        f.chmod(0o644)
        f.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))


def test_every_front_end_walks_back_from_a_damaged_checkpoint_by_one_rule(tmp_path: Path) -> None:
    """The resume walk is core's (`checkpoint::walk`): newest first, and a
    checkpoint that does not read back is passed over for the one before,
    with the same warning naming it. An `hs.loop` run stopped in its third
    epoch, its newest checkpoint damaged, resumes from the one before and
    ends on the uninterrupted weights; a fit's `latest(verify=True)` passes
    over its damaged newest one the same way (unverified it names it, and
    loading it refuses: never a damaged state)."""
    import torch

    import hindsight as hs
    from hindsight import _native
    from hindsight.errors import CorruptError
    from hindsight.lightning import latest, load

    (tmp_path / "train.py").write_text(WALK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HINDSIGHT_")}
    env.update(HINDSIGHT_HOME=str(tmp_path / ".hindsight"), HINDSIGHT_CHECKPOINT_EVERY="1", OMP_NUM_THREADS="1")

    def train(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "train.py"],
            cwd=tmp_path,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
        )

    whole = train()
    assert whole.returncode == 0, whole.stderr[-3000:]
    shutil.rmtree(tmp_path / ".hindsight")
    stopped = train(STOP="1")
    assert stopped.returncode == 85, stopped.stderr[-3000:]
    store = tmp_path / ".hindsight" / "store"
    with hs.Store(store) as s:
        names = s.list()
    newest, older = names[-1], names[-2]
    damage(store, newest)
    resumed = train()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    warning = f"hindsight: WARNING: checkpoint {newest} is damaged ("
    assert warning in resumed.stderr and "; resuming from an older one" in resumed.stderr, resumed.stderr[-3000:]
    assert f"continues from checkpoint {older} " in resumed.stderr, resumed.stderr[-3000:]
    assert resumed.stdout == whole.stdout  # the same weights as never stopped

    # A fit's walk: the same rule, the same warning.
    fits = tmp_path / "fits"
    with hs.Store(fits) as s:
        for epoch in range(2):
            s.save(_native.CheckpointId("lightning", "epoch", epoch).name, {"w": torch.full((64,), float(epoch + 1))})
    damage(fits, "lightning.epoch-000001")
    assert latest(fits) == "lightning.epoch-000001"
    with pytest.raises(CorruptError):
        load(fits, "lightning.epoch-000001")
    with pytest.warns(
        UserWarning, match=re.escape("hindsight: WARNING: checkpoint lightning.epoch-000001 is damaged (")
    ):
        assert latest(fits, verify=True) == "lightning.epoch-000000"


def test_the_replay_grammar_names_every_registered_launcher() -> None:
    """`--launcher` is parsed by the command's one grammar (clap, in the
    engine) and carried out by `hindsight._launch.LAUNCHERS`: the two name
    the same launchers, so none is refused by one and accepted by the other."""
    from hindsight._launch import LAUNCHERS

    r = subprocess.run(
        [sys.executable, "-m", "hindsight", "replay", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    after = r.stdout.split("--launcher", 1)[1]
    listed = after.split("[possible values: ", 1)[1].split("]", 1)[0].split(", ")
    assert sorted(listed) == sorted(LAUNCHERS), (listed, sorted(LAUNCHERS))

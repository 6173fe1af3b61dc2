"""hindsight.lightning under LightningCLI, shaped like Lightning's own
autoencoder example (`examples/pytorch/basics/autoencoder.py`): the logger and
callback given as LightningCLI defaults or on its command line, a
ModelCheckpoint monitoring a validation metric, `trainer.test(ckpt_path="best")`
after fit; recorded, preempted and resumed, and replayed with a probe in a hook
the recording did not have. Real processes; skipped when Lightning or
jsonargparse is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import hindsight_cmd

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")
pytest.importorskip("jsonargparse")

# The script's defaults: "defaults" gives the logger and callback as
# LightningCLI trainer_defaults (lazy_instance), "plain" gives neither (the
# command line adds them). STOP_AT=<global step>: a SIGTERM then, once.
# TEST_CKPT=model: test the fitted module instead of ckpt_path="best".
# OVERWRITE=0: LightningCLI's default, SaveConfigCallback refuses to overwrite config.yaml.
CLI_SCRIPT = """
import os, signal
import torch
import lightning.pytorch as pl
from jsonargparse import lazy_instance
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset

from hindsight.lightning import HindsightCheckpoint, HindsightLogger


class LitAutoEncoder(pl.LightningModule):
    def __init__(self, hidden_dim: int = 8, learning_rate: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(16, hidden_dim), torch.nn.ReLU(), torch.nn.Linear(hidden_dim, 3))
        self.decoder = torch.nn.Sequential(torch.nn.Linear(3, hidden_dim), torch.nn.ReLU(), torch.nn.Linear(hidden_dim, 16))

    def forward(self, x):
        return self.decoder(self.encoder(x))

    def _common_step(self, batch, stage):
        (x,) = batch
        loss = torch.nn.functional.mse_loss(self(x), x)
        self.log(f"{stage}_loss", loss, on_step=True)
        return loss

    def training_step(self, batch, batch_idx):
        if self.global_step == int(os.environ.get("STOP_AT", -1)) and not os.path.exists("stopped"):
            open("stopped", "w").close()
            os.kill(os.getpid(), signal.SIGTERM)  # preemption: handled at this step's end
        return self._common_step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._common_step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._common_step(batch, "test")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


class MyDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int = 16):
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        self.train, self.val, self.test = (TensorDataset(torch.randn(n, 16, generator=g)) for n in (64, 32, 32))

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test, batch_size=self.batch_size)


def cli_main():
    defaults = {"max_epochs": 3, "enable_progress_bar": False, "enable_model_summary": False, "log_every_n_steps": 1,
                "callbacks": [ModelCheckpoint(monitor="val_loss_epoch", save_top_k=1)]}
    if DEFAULTS:
        defaults["logger"] = lazy_instance(HindsightLogger)
        defaults["callbacks"].append(HindsightCheckpoint())
    cli = LightningCLI(LitAutoEncoder, MyDataModule, seed_everything_default=1234,
                       save_config_kwargs={"overwrite": os.environ.get("OVERWRITE", "1") == "1"}, run=False,
                       trainer_defaults=defaults)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=HindsightCheckpoint.latest_path())
    if os.environ.get("TEST_CKPT") == "model":  # the model as fit left it
        cli.trainer.test(cli.model, datamodule=cli.datamodule)
    else:
        cli.trainer.test(ckpt_path="best", datamodule=cli.datamodule)


if __name__ == "__main__":
    cli_main()
"""
ON_THE_COMMAND_LINE = [
    "--trainer.logger=hindsight.lightning.HindsightLogger",
    "--trainer.callbacks+=hindsight.lightning.HindsightCheckpoint",
]
# A probe in a hook the recorded module does not define.
PROBE = (
    "    def configure_optimizers(self):",
    '    def on_validation_epoch_end(self):\n        hs.log("enc_norm", self.encoder[0].weight.norm().item())\n\n'
    "    def configure_optimizers(self):",
)


def _script(defaults: bool, probe: bool = False) -> str:
    src = CLI_SCRIPT.replace("if DEFAULTS:", f"if {defaults}:")
    if probe:
        assert PROBE[0] in src
        src = src.replace(PROBE[0], PROBE[1], 1).replace("import torch\n", "import torch\nimport hindsight as hs\n", 1)
    return src


def _env(root: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "HINDSIGHT_HOME": str(root / "home")}
    env.pop("STOP_AT", None)
    env.pop("TEST_CKPT", None)
    env.pop("OVERWRITE", None)
    env.update(extra)
    return env


def _run(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=root,
        env=_env(root, **env),
        capture_output=True,
        text=True,
        timeout=180,
    )


def _record(root: Path, src: str, *args: str) -> None:
    root.mkdir()
    (root / "train.py").write_text(src)
    r = _run(root, *args)
    assert r.returncode == 0, r.stderr[-3000:]


def _values(home: Path) -> tuple[Any, dict[str, dict[tuple, tuple[Any, Any]]]]:
    """(the project's only run, {name: {(ctx..., rep): (recorded, replayed)}})."""
    from hindsight import _native

    db = _native.LogDb(str(home / "logs.db"))
    (run,) = db.runs()
    out: dict[str, dict[tuple, tuple[Any, Any]]] = {}
    for v in db.values(run.id):
        out.setdefault(v.name, {})[(*v.ctx, v.rep)] = (
            None if v.recorded is None else json.loads(v.recorded),
            None if v.replayed is None else json.loads(v.replayed),
        )
    return run, out


def _ckpts(home: Path) -> list[Path]:
    """ModelCheckpoint's files: in the HindsightLogger's save_dir, the run's directory in the project home."""
    return sorted((home / "lightning").glob("*/hindsight/*/checkpoints/*.ckpt"))


def _replay(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*hindsight_cmd(), "replay", "train.py", "-q", *args],
        cwd=root,
        env=_env(root, **env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_lightning_cli_records_and_replays_a_probe_in_a_new_hook(tmp_path: Path) -> None:
    """LightningCLI with HindsightLogger (lazy_instance) and HindsightCheckpoint()
    as trainer defaults records the run (config.yaml in the run's directory,
    every .ckpt loadable with weights_only=True). A probe in a hook the
    recording did not have replays from the checkpoints alone: its values
    are those of the recorded epochs' weights, every recorded value Lightning logs
    again (validation steps included) equals the recorded one, and
    `test(ckpt_path="best")` evaluates the checkpoint the recording evaluated
    (not the last epoch's model, which the replay's fit leaves)."""
    proj = tmp_path / "proj"
    _record(proj, _script(True))
    home = proj / "home"
    run, got = _values(home)
    assert (home / "lightning" / run.id / "config.yaml").is_file()
    (best,) = _ckpts(home)  # save_top_k=1
    assert not best.name.startswith("epoch=2-"), "the best epoch must not be the last, or this test cannot fail"
    for f in _ckpts(home):
        assert "state_dict" in torch.load(f, weights_only=True)
    assert sorted(got["val_loss_step"]) == [(("epoch", e), ("step", i), 0) for e in range(3) for i in range(2)]
    recorded_test = got["test_loss_epoch"]
    assert len(recorded_test) == 1

    (proj / "train.py").write_text(_script(True, probe=True))
    r = _replay(proj)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "partial replay of enc_norm" in r.stdout
    assert "3 restored from checkpoints, 0 inner-loop steps executed" in r.stdout
    assert "DIVERGENCE" not in r.stderr
    _, got = _values(home)
    from hindsight.lightning import load

    # Validation at an epoch's end sees the weights of its epoch-end checkpoint.
    want = {
        (("epoch", e), 0): load(home / "store", f"lightning.epoch-{e:06d}")["state_dict"]["encoder.0.weight"]
        .norm()
        .item()
        for e in range(3)
    }
    assert {c: v[1] for c, v in got["enc_norm"].items()} == want
    for name in ("val_loss_step", "val_loss_epoch", "test_loss_step", "test_loss_epoch"):
        assert got[name] and all(rec is not None and rec == rep for rec, rep in got[name].values()), name
    assert {c: v[0] for c, v in got["test_loss_epoch"].items()} == {c: v[0] for c, v in recorded_test.items()}


def test_lightning_cli_replay_refuses_a_best_checkpoint_changed_since_the_recording(tmp_path: Path) -> None:
    """The file `ckpt_path="best"` named when the recording evaluated it is
    checked unchanged before a replay evaluates it: rewritten, the replay
    fails naming it, and no test value is replayed (the epochs' probe values,
    computed before, are kept as the driver keeps finished iterations')."""
    proj = tmp_path / "proj"
    _record(proj, _script(True))
    (best,) = _ckpts(proj / "home")
    os.utime(best, ns=(best.stat().st_atime_ns, best.stat().st_mtime_ns + 10**9))  # another write
    (proj / "train.py").write_text(_script(True, probe=True))
    r = _replay(proj)
    assert r.returncode != 0
    assert f"the recording evaluated {best}" in r.stderr
    assert "was changed since the recorded fit ended" in r.stderr
    _, got = _values(proj / "home")
    assert got["test_loss_epoch"] and all(rep is None for _, rep in got["test_loss_epoch"].values())


def test_lightning_cli_command_line_sigterm_exits_85_and_resumes(tmp_path: Path) -> None:
    """`--trainer.logger=hindsight.lightning.HindsightLogger` and
    `--trainer.callbacks+=hindsight.lightning.HindsightCheckpoint` (no store:
    the project's): a SIGTERM mid-fit checkpoints and exits 85, the same
    command resumes (`latest_path()`) and finishes, in the same run (its
    config.yaml written again by LightningCLI, which by default refuses to
    overwrite one), with every value of an uninterrupted run at its place
    (bit-identical resume is test_lightning's)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text(_script(False))
    # LightningCLI's own default: config.yaml is not overwritten, except by the relaunch of its run.
    first = _run(proj, *ON_THE_COMMAND_LINE, STOP_AT="5", OVERWRITE="0")
    assert first.returncode == 85, first.stderr[-3000:]
    assert "checkpointed lightning.epoch-000001.step-000000006;" in first.stderr
    again = _run(proj, *ON_THE_COMMAND_LINE, STOP_AT="5", OVERWRITE="0")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Restoring states from the checkpoint path at hindsight://lightning.epoch-000001.step-000000006" in (
        again.stdout + again.stderr
    )
    run, got = _values(proj / "home")
    assert run.status == "completed"
    # 3 epochs of 4 steps, 2 validation and 2 test batches; the epoch values at
    # the epoch's last step, the test's at the fit's end (epoch 3, 12 steps).
    e_s = [(e, s) for e in range(3) for s in range(4 * e, 4 * e + 4)]
    assert {k: sorted(c[:-1] for c in v) for k, v in got.items()} == {
        "train_loss": [(("epoch", e), ("step", s)) for e, s in e_s],
        "val_loss_step": [(("epoch", e), ("step", i)) for e in range(3) for i in range(2)],
        "val_loss_epoch": [(("epoch", e), ("step", 4 * e + 3)) for e in range(3)],
        "test_loss_step": [(("epoch", 3), ("step", i)) for i in range(2)],
        "test_loss_epoch": [(("epoch", 3), ("step", 12))],
    }
    assert all(rep == 0 for v in got.values() for c in v for rep in [c[-1]])


def test_lightning_cli_replay_of_some_epochs_evaluates_the_recorded_model_or_refuses(tmp_path: Path) -> None:
    """With --where, the replay's fit stops at the last epoch it needs: the
    recorded `test(ckpt_path="best")` still evaluates the recorded best file,
    its values logged where the recording logged them (the end of the recorded
    fit); a test of the fitted module itself, which is not the recorded
    final model then, is refused naming the reason."""
    proj = tmp_path / "proj"
    _record(proj, _script(True))
    (proj / "train.py").write_text(_script(True, probe=True))
    r = _replay(proj, "--where", "epoch == 0")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "DIVERGENCE" not in r.stderr
    _, got = _values(proj / "home")
    assert sorted(got["enc_norm"]) == [(("epoch", 0), 0)]
    for name in ("test_loss_step", "test_loss_epoch"):
        assert got[name] and all(rec is not None and rec == rep for rec, rep in got[name].values()), name
    assert [c[:2] for c in got["test_loss_epoch"]] == [(("epoch", 3), ("step", 12))]

    r = _replay(proj, "--where", "epoch == 0", TEST_CKPT="model")
    assert r.returncode != 0
    assert "this replay's fit stopped before the recording's last epoch" in r.stderr

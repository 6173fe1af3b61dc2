"""hindsight.lightning: the PyTorch Lightning callback and CheckpointIO, on CPU
with real Trainer.fit runs and real signals. Skipped when Lightning is absent."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, run_py

torch = pytest.importorskip("torch")

# Lightning (with torch 2.15) warns about its own use of a deprecated torch API,
# about mid-epoch resume with a plain DataLoader (documented behaviour), and,
# on machines with many cores, about DataLoaders with few workers (advice
# about speed; the `pl` fixture makes every machine look like a 16-core one
# so this filter is exercised here too, not first on a user's machine).
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*dataloader is not resumable.*"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
]

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def put_back(original: dict[Any, Any]) -> dict[Any, Any]:
    """The handlers after fit: the ones found, except that a default SIGUSR1,
    or hindsight's own from its import (either would end the code after fit),
    becomes hindsight's note-only one."""
    from hindsight import _preemption

    def after(s: Any, h: Any) -> Any:
        return _preemption._outside if s == signal.SIGUSR1 and (h == signal.SIG_DFL or h is _preemption._early) else h

    return {s: after(s, h) for s, h in original.items()}


@pytest.fixture
def pl(monkeypatch: pytest.MonkeyPatch) -> Any:
    """lightning.pytorch; global state Trainer(deterministic=True) and
    seed_everything change is put back afterwards, signal handlers too."""
    pytest.importorskip("lightning")
    import lightning.pytorch as pl
    from lightning.pytorch.trainer.connectors import data_connector

    # As on a 16-core machine (see pytestmark).
    monkeypatch.setattr(data_connector, "suggested_max_num_workers", lambda num_devices: 15)

    for var in (
        "PL_GLOBAL_SEED",
        "PL_SEED_WORKERS",
        "CUBLAS_WORKSPACE_CONFIG",
        "HINDSIGHT_EXIT_CODE",
        "_CONDOR_JOB_AD",
        "SLURM_JOB_ID",
        "HINDSIGHT_SLURM_REQUEUE",
    ):
        monkeypatch.delenv(var, raising=False)
    det = torch.are_deterministic_algorithms_enabled()
    handlers = {s: signal.getsignal(s) for s in SIGNALS}
    yield pl
    torch.use_deterministic_algorithms(det)
    for s, h in handlers.items():
        signal.signal(s, h)


def _classes(pl: Any) -> Any:
    class Tiny(pl.LightningModule):
        """Linear-dropout-linear regression; logs a per-epoch score for keep_best."""

        def __init__(
            self, lr: float = 0.05, scores: list[float] | None = None, signal_at: int | None = None, extra: Any = None
        ) -> None:
            super().__init__()
            self.save_hyperparameters("lr", "extra")
            self.scores = scores
            self.signal_at = signal_at
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
            self.epochs_trained: list[int] = []  # epochs in which training steps ran
            self.first_step: int | None = None  # global step before the first training step

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if self.first_step is None:
                self.first_step = self.global_step
            if self.current_epoch not in self.epochs_trained:
                self.epochs_trained.append(self.current_epoch)
            if self.signal_at is not None and self.global_step == self.signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)  # preemption notice, handled at the batch end
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            if self.scores is not None:
                self.log("score", self.scores[self.current_epoch], on_step=False, on_epoch=True)
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)}

    return Tiny


def _loader() -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    return DataLoader(ds, batch_size=8, shuffle=True)  # 8 steps per epoch, order drawn from the global RNG


def _fit(
    pl: Any, root: Path, epochs: int, callbacks: list[Any], ckpt_path: str | None = None, **model_kw: Any
) -> tuple[Any, Any]:
    pl.seed_everything(0, verbose=False)
    model = _classes(pl)(**model_kw)
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=callbacks,
        deterministic=True,
        default_root_dir=root,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, _loader(), ckpt_path=ckpt_path)
    return model, trainer


def _same_weights(a: Any, b: Any) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_epochs_retention_and_exact_resume(pl: Any, tmp_path: Path) -> None:
    import hindsight as hs
    from hindsight.lightning import HindsightCheckpoint

    reference, _ = _fit(pl, tmp_path, 5, [])

    store = hs.Store(tmp_path / "store")
    cb = HindsightCheckpoint(store, keep_last=2)
    saved: list[str | None] = []

    class Probe(pl.Callback):  # runs after cb (callbacks run in list order)
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            saved.append(cb.last_saved)

    original = {s: signal.getsignal(s) for s in SIGNALS}
    model3, _t3 = _fit(pl, tmp_path, 3, [cb, Probe()])
    assert saved == ["lightning.epoch-000000", "lightning.epoch-000001", "lightning.epoch-000002"]
    # retention keep_last=2 after fit end (removed durably, chunks gc'ed); the
    # `.end` mark says the fit finished
    assert store.list() == ["lightning.epoch-000001", "lightning.epoch-000002", "lightning.epoch-000003.end"]
    assert store.verify() == []
    assert {s: signal.getsignal(s) for s in SIGNALS} == put_back(original)  # handlers put back
    info = store.info("lightning.epoch-000002")
    assert info["meta"]["epoch"] == "2" and info["meta"]["global_step"] == "24"

    ckpt = hs.lightning.load(store)  # the dict Lightning would restore
    assert ckpt["epoch"] == 2 and ckpt["global_step"] == 24
    assert ckpt["hyper_parameters"] == {"lr": 0.05, "extra": None}
    assert set(ckpt) >= {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks"}
    assert torch.equal(ckpt["state_dict"]["net.0.weight"], model3.net[0].weight)
    assert list(ckpt["state_dict"]) == list(model3.state_dict())

    # A finished fit is not resumed by latest_path (a re-launch trains afresh) ...
    assert HindsightCheckpoint.latest_path(store) is None
    assert HindsightCheckpoint.latest_path(tmp_path / "missing") is None
    assert [e.name for e in HindsightCheckpoint.checkpoints(store)] == [
        "lightning.epoch-000001",
        "lightning.epoch-000002",
    ]
    # ... but named explicitly, its last epoch extends to 5 epochs.
    path = "hindsight://lightning.epoch-000002"
    cb5 = HindsightCheckpoint(store, keep_last=2)
    model5, t5 = _fit(pl, tmp_path, 5, [cb5], ckpt_path=path)
    assert model5.epochs_trained == [3, 4] and model5.first_step == 24  # resumed at epoch 3
    assert t5.global_step == 40
    assert _same_weights(model5, reference)  # bit-identical to the uninterrupted 5-epoch fit
    assert store.list() == ["lightning.epoch-000003", "lightning.epoch-000004", "lightning.epoch-000005.end"]

    # The installed CheckpointIO passes ordinary paths through and writes hindsight:// ones.
    t5.save_checkpoint(tmp_path / "plain.ckpt")
    assert (tmp_path / "plain.ckpt").exists()
    t5.save_checkpoint("hindsight://manual")
    store.flush()
    assert "manual" in store.list()


def test_keep_best_and_keep_every(pl: Any, tmp_path: Path) -> None:
    import hindsight as hs
    from hindsight.lightning import HindsightCheckpoint

    store = hs.Store(tmp_path / "store")
    scores = [3.0, 1.0, 2.0, 4.0, 5.0, 6.0]
    cb = HindsightCheckpoint(store, keep_last=1, keep_best=1, monitor="score", mode="min", keep_every=4)
    _fit(pl, tmp_path, 6, [cb], scores=scores)
    # best (epoch 1, score 1.0), every 4th (epochs 0, 4), newest (epoch 5)
    assert store.list() == [
        "lightning.epoch-000000",
        "lightning.epoch-000001",
        "lightning.epoch-000004",
        "lightning.epoch-000005",
        "lightning.epoch-000006.end",  # the fit finished
    ]
    assert store.info("lightning.epoch-000001")["meta"]["metric"] == "1.0"


def test_signal_in_process_then_resume(pl: Any, tmp_path: Path) -> None:
    import hindsight as hs
    from hindsight.lightning import HindsightCheckpoint

    store = hs.Store(tmp_path / "store")
    cb = HindsightCheckpoint(store)
    original = {s: signal.getsignal(s) for s in SIGNALS}
    with pytest.raises(SystemExit) as exc:
        _fit(pl, tmp_path, 2, [cb], signal_at=11)  # epoch 1, 4th batch
    assert exc.value.code == 85
    assert {s: signal.getsignal(s) for s in SIGNALS} == put_back(original)  # handlers put back
    assert cb.stop_signal == signal.SIGUSR1
    # global step 12 was done when the flag was seen; the checkpoint is durable
    assert store.list() == ["lightning.epoch-000000", "lightning.epoch-000001.step-000000012"]
    assert store.verify() == []
    assert HindsightCheckpoint.latest(store) == "lightning.epoch-000001.step-000000012"

    cb2 = HindsightCheckpoint(store, keep_last=1)
    model, t = _fit(pl, tmp_path, 2, [cb2], ckpt_path=cb2.resume_path())
    assert model.epochs_trained == [1] and model.first_step == 12  # resumed at the next step
    assert t.global_step == 16
    # the mid-epoch one is superseded; the fit finished
    assert store.list() == ["lightning.epoch-000001", "lightning.epoch-000002.end"]
    # Not compared with `reference`: with a plain DataLoader Lightning draws the
    # rest of the epoch from a fresh iterator (documented limitation).


def test_signal_exit_code_from_environment(pl: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hindsight as hs
    from hindsight.lightning import HindsightCheckpoint

    ad = tmp_path / "job.ad"
    ad.write_text('Owner = "me"\nCheckpointExitCode = 77\n')
    monkeypatch.setenv("_CONDOR_JOB_AD", str(ad))
    store = hs.Store(tmp_path / "store")
    with pytest.raises(SystemExit) as exc:
        _fit(pl, tmp_path, 1, [HindsightCheckpoint(store)], signal_at=2)
    assert exc.value.code == 77
    with pytest.raises(SystemExit) as exc:
        _fit(pl, tmp_path, 1, [HindsightCheckpoint(store, exit_code=3)], signal_at=2)
    assert exc.value.code == 3


def test_unsupported_hyperparameters_fail_at_fit_start(pl: Any, tmp_path: Path) -> None:
    import hindsight as hs
    from hindsight.lightning import HindsightCheckpoint

    store = hs.Store(tmp_path / "store")
    with pytest.raises(hs.UnsupportedTypeError, match=r"hyper_parameters/extra .*PosixPath.*allow_pickle"):
        _fit(pl, tmp_path, 1, [HindsightCheckpoint(store)], extra=Path("/data"))
    assert store.list() == []

    _fit(pl, tmp_path, 1, [HindsightCheckpoint(store, allow_pickle=True)], extra=Path("/data"))
    with pytest.raises(hs.UnsupportedTypeError, match="allow_pickle"):
        hs.lightning.load(store)
    assert hs.lightning.load(store, allow_pickle=True)["hyper_parameters"]["extra"] == Path("/data")
    # resume through the CheckpointIO the callback installs (with its allow_pickle)
    cb = HindsightCheckpoint(store, allow_pickle=True)
    assert cb.resume_path() is None  # that fit finished; extend it by naming its last epoch
    model, _t = _fit(pl, tmp_path, 2, [cb], ckpt_path="hindsight://lightning.epoch-000000", extra=Path("/data"))
    assert model.epochs_trained == [1]


def test_arguments_are_checked(pl: Any, tmp_path: Path) -> None:
    import hindsight as hs
    from hindsight.lightning import HindsightCheckpoint

    with pytest.raises(hs.InvalidArgumentError, match="monitor"):
        HindsightCheckpoint(tmp_path, keep_best=1)
    with pytest.raises(hs.InvalidArgumentError, match="mode"):
        HindsightCheckpoint(tmp_path, monitor="x", mode="best")
    with pytest.raises(hs.InvalidArgumentError, match="every_n_train_steps"):
        HindsightCheckpoint(tmp_path, every_n_train_steps=0)
    # One rule for every front end's period (it accepted True as 1 here,
    # where the Trainer callback refused it).
    with pytest.raises(hs.InvalidArgumentError, match=r"HindsightCheckpoint\(every_n_epochs=True\)"):
        HindsightCheckpoint(tmp_path, every_n_epochs=True)
    with pytest.raises(hs.InvalidArgumentError, match=r"hs.checkpointing\(every=True\): give a whole number"):
        with hs.checkpointing(every=True):
            pass
    with pytest.raises(hs.InvalidArgumentError, match="prefix"):
        HindsightCheckpoint(tmp_path, prefix="a/b")


def test_every_n_train_steps(pl: Any, tmp_path: Path) -> None:
    import hindsight as hs
    from hindsight.lightning import HindsightCheckpoint

    store = hs.Store(tmp_path / "store")
    cb = HindsightCheckpoint(store, every_n_epochs=None, every_n_train_steps=3)
    _fit(pl, tmp_path, 2, [cb])
    # steps 3, 6, 9, 12, 15 (step 8 and 16 end an epoch: no step checkpoint there)
    assert store.list() == [
        *(f"lightning.epoch-{s // 8:06d}.step-{s:09d}" for s in (3, 6, 9, 12, 15)),
        "lightning.epoch-000002.end",
    ]
    assert hs.lightning.load(store)["global_step"] == 15


TRAIN_SCRIPT = """
import sys, time
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
from hindsight.lightning import HindsightCheckpoint

store = sys.argv[1]

class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        print(f"step {self.current_epoch} {self.global_step}", flush=True)
        time.sleep(0.03)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

pl.seed_everything(0, verbose=False)
g = torch.Generator().manual_seed(0)
dl = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=4)
trainer = pl.Trainer(max_epochs=2, enable_progress_bar=False, logger=False, enable_checkpointing=False,
                     enable_model_summary=False, default_root_dir=sys.argv[2],
                     callbacks=[HindsightCheckpoint(store, keep_last=2)])
trainer.fit(M(), dl, ckpt_path=HindsightCheckpoint.latest_path(store))
print("done", trainer.current_epoch, trainer.global_step, flush=True)
"""


def test_sigterm_subprocess_exits_85_and_resumes(pl: Any, tmp_path: Path) -> None:
    import hindsight as hs

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN_SCRIPT))
    store_dir = tmp_path / "store"
    cmd = [sys.executable, str(script), str(store_dir), str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 90
        for line in proc.stdout:
            if line.startswith("step 1 20"):  # 16 steps per epoch: mid-epoch 1
                proc.send_signal(signal.SIGTERM)
                break
            assert time.monotonic() < deadline
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 85, err[-2000:]
    assert "exiting with 85" in err
    names = hs.Store(store_dir).list()
    mid = [n for n in names if ".step-" in n]
    assert len(mid) == 1 and mid[0].startswith("lightning.epoch-000001.step-0000000")
    step = int(mid[0].rsplit("-", 1)[1])
    assert 21 <= step < 32

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    lines = again.stdout.splitlines()
    assert lines[0] == f"step 1 {step}"  # resumed at the next step
    assert lines[-1] == "done 2 32"
    assert hs.Store(store_dir).list() == [
        "lightning.epoch-000000",
        "lightning.epoch-000001",
        "lightning.epoch-000002.end",
    ]
    # Run again, now finished: a new fit from scratch under a prefix of its own,
    # the finished one untouched (it used to restore the last epoch and train nothing).
    fresh = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert fresh.stdout.splitlines()[0] == "step 0 0" and fresh.stdout.splitlines()[-1] == "done 2 32"
    assert hs.Store(store_dir).list() == [
        "lightning.epoch-000000",
        "lightning.epoch-000001",
        "lightning.epoch-000002.end",
        "lightning.fit2.epoch-000000",
        "lightning.fit2.epoch-000001",
        "lightning.fit2.epoch-000002.end",
    ]


def test_import_error_names_the_package() -> None:
    r = run_py(
        """
        import sys
        sys.modules["lightning"] = None
        sys.modules["lightning.pytorch"] = None
        sys.modules["pytorch_lightning"] = None
        import hindsight.lightning as hl    # importing the module needs no Lightning
        assert hl.latest("/nonexistent/store") is None
        try:
            hl.HindsightCheckpoint
        except ImportError as e:
            print("ImportError:", e)
        """
    )
    assert r.returncode == 0, r.stderr
    assert "ImportError: hindsight.lightning needs PyTorch Lightning: `pip install lightning`" in r.stdout


SHARED_RULE_SCRIPT = """
import sys, torch, hindsight as hs
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
with hs.checkpointing(model=net, optimizer=opt, every=1, keep_last=2, store=sys.argv[1]):
    for epoch in hs.loop("epoch", range(4)):
        for _ in hs.loop("step", range(3)):
            net.weight.data.add_(1.0)
"""


def test_one_naming_and_retention_rule_with_hs_checkpointing(pl: Any, tmp_path: Path) -> None:
    """hs.checkpointing and the Lightning callback name and prune checkpoints
    by the same engine rule: the same epochs survive under the same names,
    only the prefix (run id vs callback prefix) differs."""
    import hindsight as hs
    from hindsight import _native
    from hindsight.lightning import HindsightCheckpoint

    store_dir = tmp_path / "store"
    script = tmp_path / "train.py"
    script.write_text(SHARED_RULE_SCRIPT)
    r = subprocess.run(
        [sys.executable, str(script), str(store_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HINDSIGHT_HOME": str(tmp_path / "home")},
    )
    assert r.returncode == 0, r.stderr
    store = hs.Store(store_dir)
    (run_prefix,) = {n.split(".", 1)[0] for n in store.list()}
    _fit(pl, tmp_path, 4, [HindsightCheckpoint(store, prefix="shared", keep_last=2)])

    def ids(prefix: str) -> list[tuple[str, int, str]]:
        # (the callback's `.end` mark of a finished fit is not a training checkpoint)
        return [(c.loop_name, c.index, c.kind) for c in store.checkpoints(prefix) if c.kind != "end"]

    assert ids(run_prefix) == ids("shared") == [("epoch", 2, "block"), ("epoch", 3, "block")]
    for name in store.list():
        ck = _native.CheckpointId.parse(name)
        assert ck is not None and ck.name == name
    assert sorted(n.split(".", 1)[1] for n in store.list() if n.startswith("shared.")) == sorted(
        [*(n.split(".", 1)[1] for n in store.list() if n.startswith(run_prefix + ".")), "epoch-000004.end"]
    )
    # Interim names share one format too (9-digit steps).
    assert _native.CheckpointId("shared", "epoch", 1, "step", 12).name == "shared.epoch-000001.step-000000012"


class Script:
    """`python <argv>` in `cwd`, forked from a process that imported torch and
    Lightning once (`hindsight replay`'s zygote): a process of its own, as a
    relaunch is, without importing them again (5-10 s a run on 2 busy cores).
    One torch thread, in its data workers too: tiny steps on a busy machine
    are many times slower with more, and every run computes alike."""

    def __init__(self, zygote: Any, cwd: Path, argv: list[str], env: dict[str, str], tag: str) -> None:
        self.zygote = zygote
        self.out, self.err = cwd / f"{tag}.out", cwd / f"{tag}.err"
        fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) for p in (self.out, self.err)]
        fds.append(os.open(os.devnull, os.O_WRONLY))
        env = {**env, "OMP_NUM_THREADS": "1"}
        try:
            self.n = zygote.fork([sys.executable, *argv], str(cwd), env, tuple(fds), 1)
        finally:
            for fd in fds:
                os.close(fd)
        self.pid = zygote.pids[self.n]

    def running(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False  # exited, and reaped by the zygote
        return True

    def wait(self) -> subprocess.CompletedProcess[str]:
        """Its exit status (negative: killed by that signal), stdout and stderr."""
        code = self.zygote.wait(self.n)
        return subprocess.CompletedProcess([], code, self.out.read_text(), self.err.read_text())


@pytest.fixture(scope="module")
def zygote() -> Any:
    pytest.importorskip("lightning")
    from hindsight._zygote import Zygote

    z = Zygote(["torch", "lightning.pytorch"], dict(os.environ))
    z.sock.settimeout(300)  # a hung script fails its test
    yield z
    z.close()


LOGGED_SCRIPT = """
import os, sys, time
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
import hindsight as hs
from hindsight.lightning import HindsightCheckpoint, HindsightLogger

class M(pl.LightningModule):
    def __init__(self, lr=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(0.03)
        if self.global_step == int(os.environ.get("PAUSE_AT", "-1")):
            print("paused at", self.global_step, flush=True)
            time.sleep(300)  # until the test kills the process
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        # Handed to the loggers after the callback's epoch-end checkpoint.
        self.log("loss_mean", loss, on_step=False, on_epoch=True)
        hs.log("w0", self.net.weight[0, 0].item())
        return loss

    def on_train_epoch_end(self):
        hs.log("w_end", self.net.weight.sum().item())  # after the callback's epoch-end checkpoint too

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def on_validation_epoch_end(self):
        hs.log("bias", self.net.bias.item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

pl.seed_everything(0, verbose=False)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
store = sys.argv[1]
trainer = pl.Trainer(max_epochs=3, enable_progress_bar=False, enable_checkpointing=False, log_every_n_steps=1,
                     enable_model_summary=False, default_root_dir=sys.argv[2], num_sanity_val_steps=0,
                     logger=HindsightLogger(), callbacks=[HindsightCheckpoint(store)])
trainer.fit(M(lr=float(sys.argv[3])), DataLoader(data, batch_size=4), DataLoader(data, batch_size=8),
            ckpt_path=HindsightCheckpoint.latest_path(store))
print("done", trainer.global_step, flush=True)
"""


def _lightning_logs(home: Path) -> tuple[list[Any], dict[str, dict[tuple, float]]]:
    from hindsight import _native

    db = _native.LogDb(str(home / "logs.db"))
    runs = db.runs()
    out: dict[str, dict[tuple, float]] = {}
    for v in db.values(runs[0].id) if runs else []:
        out.setdefault(v.name, {})[(*v.ctx, v.rep)] = float(v.value_json)
    return runs, out


def _logged(zygote: Any, root: Path, tag: str, **env: str) -> Script:
    """LOGGED_SCRIPT as root/train.py, started (project home root/home)."""
    (root / "train.py").write_text(LOGGED_SCRIPT)
    argv = [str(root / "train.py"), str(root / "store"), str(root / "root"), "0.05"]
    return Script(zygote, root, argv, {**os.environ, "HINDSIGHT_HOME": str(root / "home"), **env}, tag)


@pytest.fixture(scope="module")
def logged_reference(zygote: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[tuple, float]]:
    """LOGGED_SCRIPT uninterrupted, once per module: its values by name."""
    root = tmp_path_factory.mktemp("logged-ref")
    ref = _logged(zygote, root, "ref").wait()
    assert ref.returncode == 0, ref.stderr[-3000:]
    runs, want = _lightning_logs(root / "home")
    assert len(runs) == 1 and json.loads(runs[0].args_json)["lr"] == 0.05
    steps = 3 * 8
    # self.log and hs.log in one training_step share its context: the global step it trains
    per_step = [(("epoch", s // 8), ("step", s), 0) for s in range(steps)]
    assert sorted(want["train_loss"]) == sorted(want["w0"]) == per_step
    assert sorted(want["bias"]) == sorted(want["w_end"]) == [(("epoch", e), 0) for e in range(3)]
    assert len(want["val_loss"]) == len(want["loss_mean"]) == 3
    return want


def test_lightning_values_are_recorded_per_epoch_and_step_and_resume_in_the_same_run(
    pl: Any, zygote: Any, tmp_path: Path, logged_reference: dict[str, dict[tuple, float]]
) -> None:
    """self.log and hs.log in a LightningModule land in the script's hindsight
    run at (epoch, global step), the module's hyper-parameters as arguments;
    a SIGTERM and the relaunch continue the same run, every step once."""
    want = logged_reference
    p = _logged(zygote, tmp_path, "first")
    deadline = time.monotonic() + 120
    while not list((tmp_path / "store").glob("**/*epoch-000001*")) and time.monotonic() < deadline:
        if not p.running():
            break
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(p.pid, signal.SIGTERM)
    first = p.wait()
    assert first.returncode == 85, first.stderr[-3000:]
    runs, _ = _lightning_logs(tmp_path / "home")
    assert [r.status for r in runs] == ["interrupted"]
    again = _logged(zygote, tmp_path, "again").wait()
    assert again.returncode == 0, again.stderr[-3000:]
    runs, got = _lightning_logs(tmp_path / "home")
    assert [r.status for r in runs] == ["completed"]
    for name in ("train_loss", "w0", "bias", "val_loss", "loss_mean", "w_end"):
        assert got[name].keys() == want[name].keys(), name  # each context once, none lost
        # Epochs finished before the signal are bit-identical; the epoch it
        # stopped resumes from a fresh iterator of a plain DataLoader
        # (Lightning's documented limit), so its values may differ.
        done = {k: v for k, v in want[name].items() if k[0][1] < 2}
        assert {k: got[name][k] for k in done} == done, name


def test_a_kill_9_loses_no_logged_value_a_checkpoint_covers(
    pl: Any, zygote: Any, tmp_path: Path, logged_reference: dict[str, dict[tuple, float]]
) -> None:
    """HindsightLogger values and hs.log values in the module's hooks reach
    the log database by the checkpoint that covers them (those Lightning
    hands over after the epoch-end checkpoint, at the epoch's end): a kill -9
    during epoch 2 keeps every value of epochs 0 and 1, and the relaunch
    (from epoch 1's checkpoint) gives every value of an uninterrupted run,
    each once, in the same run, completed."""
    from hindsight.lightning import HindsightCheckpoint

    want = logged_reference
    p = _logged(zygote, tmp_path, "killed", PAUSE_AT="20")
    try:
        deadline = time.monotonic() + 120
        # It waits in epoch 2's fifth step, epoch 1's checkpoint (saved in the background) committed.
        while "paused at 20" not in p.out.read_text() or "lightning.epoch-000001" not in [
            e.name for e in HindsightCheckpoint.checkpoints(tmp_path / "store")
        ]:
            assert p.running() and time.monotonic() < deadline, p.err.read_text()[-3000:]
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)  # nothing runs on the way out
    assert p.wait().returncode == -signal.SIGKILL
    runs, got = _lightning_logs(tmp_path / "home")
    assert [r.status for r in runs] == ["running"]

    def covered(values: dict[str, dict[tuple, float]]) -> dict[str, dict[tuple, float]]:
        return {n: {k: v for k, v in values.get(n, {}).items() if k[0][1] < 2} for n in want}

    assert covered(got) == covered(want)
    again = _logged(zygote, tmp_path, "again").wait()
    assert again.returncode == 0, again.stderr[-3000:]
    runs, got = _lightning_logs(tmp_path / "home")
    assert [r.status for r in runs] == ["completed"]
    assert got == want


def test_a_context_that_recurs_within_an_epoch_keeps_every_value(tmp_path: Path) -> None:
    """A name logged again at a context seen earlier in the epoch, with other
    contexts between (validation between steps), is a new occurrence, not an
    overwrite of the first value."""
    code = """
from hindsight import _run
run = _run.current()
run.log_at([("epoch", 0), ("step", 0)], "x", 1.0)
run.log_at([("epoch", 0)], "y", 5.0)
run.log_at([("epoch", 0), ("step", 0)], "x", 2.0)
run.log_at([("epoch", 1), ("step", 0)], "x", 3.0)
run.flush_logs()
"""
    script = tmp_path / "s.py"
    script.write_text(code)
    r = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "HINDSIGHT_HOME": str(tmp_path / "home")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    _, got = _lightning_logs(tmp_path / "home")
    assert got["x"] == {
        (("epoch", 0), ("step", 0), 0): 1.0,
        (("epoch", 0), ("step", 0), 1): 2.0,
        (("epoch", 1), ("step", 0), 0): 3.0,
    }


REPLAY_SCRIPT = """
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
import hindsight as hs
from hindsight.lightning import HindsightCheckpoint, HindsightLogger

epochs = hs.arg("epochs", 4)
every = hs.arg("every", 1)


class M(pl.LightningModule):
    def __init__(self, lr=0.1):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))

    def norm(self):
        return sum(p.norm().item() ** 2 for p in self.parameters()) ** 0.5

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def on_train_epoch_start(self):
        pass

    def on_validation_epoch_end(self):
        pass

    def on_train_epoch_end(self):
        pass

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)]


pl.seed_everything(0, verbose=False)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
trainer = pl.Trainer(max_epochs=epochs, enable_progress_bar=False, log_every_n_steps=1,
                     enable_model_summary=False, default_root_dir="root",
                     logger=HindsightLogger(), callbacks=[HindsightCheckpoint("store", every_n_epochs=every)])
trainer.fit(M(lr=0.05), DataLoader(data, batch_size=8, shuffle=True), DataLoader(data, batch_size=16),
            ckpt_path=HindsightCheckpoint.latest_path("store"))
"""
# Probes in the module's hooks, each replacing a `pass` (or following a line).
END_PROBES = [
    (
        "    def on_train_epoch_end(self):\n        pass",
        '    def on_train_epoch_end(self):\n        hs.log("w_norm", self.norm())\n'
        '        hs.log("lr_now", self.trainer.optimizers[0].param_groups[0]["lr"])',
    ),
    (
        "    def on_validation_epoch_end(self):\n        pass",
        '    def on_validation_epoch_end(self):\n        hs.log("val_probe", self.trainer.callback_metrics["val_loss"].item())',
    ),
]
START_PROBE = (
    "    def on_train_epoch_start(self):\n        pass",
    '    def on_train_epoch_start(self):\n        hs.log("start_norm", self.norm())',
)
STEP_PROBE = (
    '        self.log("train_loss", loss)\n',
    '        self.log("train_loss", loss)\n        hs.log("w0", self.net[0].weight[0, 0].item())\n',
)


def _probed(*edits: tuple[str, str]) -> str:
    src = REPLAY_SCRIPT
    for old, new in edits:
        assert old in src
        src = src.replace(old, new, 1)
    return src


def _phases(home: Path) -> dict[str, dict[tuple, tuple[Any, Any]]]:
    """{name: {(ctx..., rep): (recorded, replayed)}} of the project's only run."""
    from hindsight import _native

    db = _native.LogDb(str(home / "logs.db"))
    (run,) = db.runs()
    out: dict[str, dict[tuple, tuple[Any, Any]]] = {}
    for v in db.values(run.id):
        out.setdefault(v.name, {})[(*v.ctx, v.rep)] = (
            None if v.recorded is None else json.loads(v.recorded),
            None if v.replayed is None else json.loads(v.replayed),
        )
    return out


def _record(root: Path, src: str, *args: str) -> None:
    """`src` recorded as root/train.py, with its project home in root/home."""
    root.mkdir()
    (root / "train.py").write_text(src)
    r = subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=root,
        env={**os.environ, "HINDSIGHT_HOME": str(root / "home")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]


def _replay(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`hindsight replay train.py --strict` in a project made by `_record`; must succeed."""
    from conftest import hindsight_cmd

    r = subprocess.run(
        [*hindsight_cmd(), "replay", "train.py", "-q", "--strict", *extra],
        cwd=root,
        env={**os.environ, "HINDSIGHT_HOME": str(root / "home")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    return r


def test_replay_of_a_lightning_script_restores_epochs_for_hook_probes(pl: Any, tmp_path: Path) -> None:
    """`hindsight replay` of a LightningModule: probes in the epoch hooks get
    the recorded epochs' state with no training step run (validation runs on
    the restored model, and its self.log values equal the recorded ones); a
    probe in on_train_epoch_start gets the previous epoch's state, also with
    --where; a probe in training_step re-executes the epochs over -j 2
    workers. Every value equals a run that had the probes from the start
    (shuffling, dropout and an LR schedule included)."""
    every = [*END_PROBES, START_PROBE, STEP_PROBE]
    ref, proj = tmp_path / "ref", tmp_path / "proj"
    _record(ref, _probed(*every))
    _record(proj, REPLAY_SCRIPT)
    want = {k: {c: v[0] for c, v in vals.items()} for k, vals in _phases(ref / "home").items()}
    assert sorted(want["w_norm"]) == [(("epoch", e), 0) for e in range(4)]
    # Lightning's sanity-check validation before epoch 0 is no epoch's: not recorded.
    assert sorted(want["val_probe"]) == [(("epoch", e), 0) for e in range(4)]
    # on_train_epoch_start is in its own epoch (the context is set before the module's hooks).
    assert sorted(want["start_norm"]) == [(("epoch", e), 0) for e in range(4)]
    assert len(want["w0"]) == 4 * 8

    def replay(*extra: str) -> subprocess.CompletedProcess[str]:
        return _replay(proj, *extra)

    def check(*names: str, epochs: range = range(4)) -> None:
        got = _phases(proj / "home")
        for name in names:
            expected = {c: v for c, v in want[name].items() if c[0][1] in epochs}
            replayed = {c: v[1] for c, v in got[name].items() if v[1] is not None}
            assert replayed == expected, name

    (proj / "train.py").write_text(_probed(*END_PROBES))
    r = replay()
    assert "partial replay of lr_now, val_probe, w_norm" in r.stdout
    assert "4 restored from checkpoints, 0 inner-loop steps executed" in r.stdout
    check("w_norm", "lr_now", "val_probe")
    # Validation ran on each restored epoch and logged what the recording did, at its step.
    val = _phases(proj / "home")["val_loss"]
    assert len(val) == 4 and all(rec is not None and rec == rep for rec, rep in val.values())

    (proj / "train.py").write_text(_probed(START_PROBE))
    r = replay("--where", "epoch >= 2")
    assert "partial replay of start_norm" in r.stdout
    assert "0 inner-loop steps executed" in r.stdout
    check("start_norm", epochs=range(2, 4))

    (proj / "train.py").write_text(_probed(STEP_PROBE))
    r = replay("-j", "2")
    assert "parallel replay of w0 on 2 worker(s)" in r.stdout
    check("w0")


LOADER_SCRIPT = """
import os, signal, sys
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset
import hindsight as hs
from hindsight.lightning import HindsightCheckpoint
import toy_data

# argv: store name, the global step after which a SIGUSR1 arrives (-1: none),
# and where: "step" (in that training_step) or "val" (in the validation
# that follows that step, which must be an epoch's last).
AT, WHERE = int(sys.argv[2]), sys.argv[3]


def preempt():
    if not os.path.exists("stopped"):
        open("stopped", "w").close()
        os.kill(os.getpid(), signal.SIGUSR1)  # handled at the next step boundary or epoch end


class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 2)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        if WHERE == "step" and self.global_step == AT:
            preempt()
        hs.log("first_x", x[0, 0].item())
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        hs.log("loss", loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        if WHERE == "val" and self.global_step - 1 == AT:
            preempt()
        x, y = batch
        hs.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y).item())

    def on_train_epoch_end(self):
        # Epoch-end values: lost if a resume skips the epoch's end.
        hs.log("w_norm", self.net[0].weight.norm().item())
        hs.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)]


pl.seed_everything(0, verbose=False)
g = torch.Generator().manual_seed(1)
val = TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 2, (64,), generator=g))
loader = hs.data.Loader(toy_data.make, batch_size=32, seed=0, workers="local:1", dataset_args={"n": 640})
trainer = pl.Trainer(max_epochs=3, enable_progress_bar=False, enable_checkpointing=False, logger=False,
                     enable_model_summary=False, num_sanity_val_steps=0, callbacks=[HindsightCheckpoint(sys.argv[1])])
model = M()
with loader:
    trainer.fit(model, loader, DataLoader(val, batch_size=64), ckpt_path=HindsightCheckpoint.latest_path(sys.argv[1]))
torch.save(model.state_dict(), sys.argv[1] + ".pt")
"""
LOADER_STEPS, LOADER_EPOCH = 60, 20  # 3 epochs of 20 batches


def _loader_run(
    zygote: Any, root: Path, name: str, at: int, where: str = "step", tag: str = "run"
) -> subprocess.CompletedProcess[str]:
    """LOADER_SCRIPT in `root` (store `name`, project home `home-<name>`), to its end."""
    if not (root / "train.py").exists():
        shutil.copy(REPO / "examples" / "toy_data.py", root / "toy_data.py")
        (root / "train.py").write_text(LOADER_SCRIPT)
    env = {**os.environ, "HINDSIGHT_HOME": str(root / f"home-{name}")}
    return Script(zygote, root, ["train.py", name, str(at), where], env, tag).wait()


def _loader_logged(root: Path, name: str) -> dict[tuple, str]:
    """Every value of the project's only run, which must have completed."""
    from hindsight import _native

    db = _native.LogDb(str(root / f"home-{name}" / "logs.db"))
    (r,) = db.runs()  # a relaunch continues the interrupted run
    assert r.status == "completed"
    return {(v.name, *v.ctx, v.rep): v.value_json for v in db.values(r.id)}


@pytest.fixture(scope="module")
def loader_reference(zygote: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[tuple, str]]:
    """LOADER_SCRIPT uninterrupted, once per module: (weights, every logged value)."""
    root = tmp_path_factory.mktemp("loader-ref")
    ref = _loader_run(zygote, root, "ref", -1)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = _loader_logged(root, "ref")
    # first_x and loss at each step; w_norm, lr and val_loss at each epoch
    assert len(want) == 2 * LOADER_STEPS + 3 * (LOADER_STEPS // LOADER_EPOCH)
    firsts = [want[("first_x", ("epoch", e), ("step", LOADER_EPOCH * e), 0)] for e in range(3)]
    assert len(set(firsts)) == 3, "each epoch has its own order"
    return torch.load(root / "ref.pt"), want


@pytest.mark.parametrize(
    ("at", "where", "checkpoint"),
    [
        (0, "step", "lightning.epoch-000000.step-000000001"),  # the first step
        (25, "step", "lightning.epoch-000001.step-000000026"),  # mid-epoch
        (19, "step", "lightning.epoch-000000"),  # an epoch's last step: acted on at the epoch's end
        (59, "step", "lightning.epoch-000002"),  # the run's last step: the relaunch trains nothing
        (39, "val", "lightning.epoch-000001"),  # after the last step, before the epoch's end hooks
    ],
    ids=["first-step", "mid-epoch", "last-step-of-epoch", "last-step-of-run", "validation-after-last-step"],
)
def test_lightning_with_the_input_service_resumes_a_signal_at_any_step_bit_identically(
    pl: Any,
    zygote: Any,
    tmp_path: Path,
    loader_reference: tuple[dict[str, Any], dict[tuple, str]],
    at: int,
    where: str,
    checkpoint: str,
) -> None:
    """Lightning saves and restores a loader with state_dict/load_state_dict
    (hs.data.Loader) in its checkpoints, so a SIGUSR1 at any step resumes at
    the exact next batch: weights and every logged value (steps, validation,
    epoch-end hooks) equal an uninterrupted run's, in one completed run. A
    signal at an epoch's last step or during the validation after it is acted
    on at the epoch's end (after its hooks), never at the last batch, which
    Lightning resumes at the next epoch. Lightning sets the loader's epoch
    through `loader.sampler.set_epoch`, so each epoch has its own order."""
    weights, want = loader_reference
    first = _loader_run(zygote, tmp_path, "int", at, where, "first")
    assert first.returncode == 85, first.stderr[-3000:]
    assert f"checkpointed {checkpoint};" in first.stderr
    again = _loader_run(zygote, tmp_path, "int", at, where, "again")
    assert again.returncode == 0, again.stderr[-3000:]
    got = torch.load(tmp_path / "int.pt")
    assert weights.keys() == got.keys() and all(torch.equal(weights[k], got[k]) for k in weights)
    assert _loader_logged(tmp_path, "int") == want


def test_lightning_replay_recomputes_epochs_without_a_checkpoint(pl: Any, tmp_path: Path) -> None:
    """With a checkpoint every second epoch, an epoch-end probe's replay
    restores the checkpointed epochs and trains the others from the one
    before (its optimizer, schedule, RNG and step counters restored), giving
    the values of a run that had the probe from the start."""
    ref, proj = tmp_path / "ref", tmp_path / "proj"
    _record(ref, _probed(*END_PROBES), "--every", "2")
    _record(proj, REPLAY_SCRIPT, "--every", "2")
    (proj / "train.py").write_text(_probed(*END_PROBES))
    r = _replay(proj)
    # Checkpoints after epochs 1 and 3; epoch 0 trains from the start, epoch 2 from epoch 1's.
    assert "2 restored from checkpoints, 16 inner-loop steps executed" in r.stdout
    want = _phases(ref / "home")
    got = _phases(proj / "home")
    for name in ("w_norm", "lr_now", "val_probe"):
        assert {c: v[1] for c, v in got[name].items()} == {c: v[0] for c, v in want[name].items()}, name

"""The Keras 3 callback (torch backend) on real `model.fit` runs: a fit
stopped by SIGTERM at any batch checkpoints, exits 85, and the same command
resumes it to the uninterrupted run's weights and logged values; retention;
an epoch-level probe added afterwards replays to the values a recording
with it logs; and what cannot be exact is refused."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import hindsight_cmd

SCRIPT = """\
import os, signal, sys
os.environ["KERAS_BACKEND"] = "torch"
import numpy as np, keras
import hindsight as hs
from hindsight.keras import HindsightCallback

keras.utils.set_random_seed(0)
x = np.random.RandomState(0).randn(256, 8).astype("float32")
y = (x[:, :1] * 2 - x[:, 1:2]).astype("float32")
model = keras.Sequential([
    keras.Input((8,)),
    keras.layers.Dense(16, activation="relu", name="hidden"),
    keras.layers.Dropout(0.2),
    keras.layers.Dense(1, name="out"),
])
model.compile(optimizer=keras.optimizers.Adam(float(os.environ.get("LR", "1e-2"))), loss="mse", metrics=["mae"], steps_per_execution=STEPS_PER_EXECUTION)
at = os.environ.get("SIGNAL_AT")


class Kill(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if at == f"{self.epoch}.{batch}" and not os.path.exists("signalled"):
            open("signalled", "w").close()
            os.kill(os.getpid(), signal.SIGTERM)


def probe(epoch, logs):
    pass  # zoo: epoch-probe


cb = HindsightCallback(keep_last=KEEP_LAST, every_n_train_steps=EVERY_STEPS)
model.fit(x, y, epochs=4, batch_size=32, validation_split=0.25, verbose=0,
          callbacks=[Kill(), keras.callbacks.LambdaCallback(on_epoch_end=probe), cb])
np.save("weights.npy", np.concatenate([v.numpy().ravel() for v in model.weights]))
"""
PROBE = 'hs.log("w_sum", float(sum(float(v.numpy().sum()) for v in model.weights)))'


def script(keep_last: int | None = None, every_steps: int | None = None, steps_per_execution: int = 1) -> str:
    return (
        SCRIPT.replace("KEEP_LAST", repr(keep_last))
        .replace("EVERY_STEPS", repr(every_steps))
        .replace("STEPS_PER_EXECUTION", repr(steps_per_execution))
    )


def env(cwd: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "HINDSIGHT_HOME": str(cwd / ".hindsight"), "OMP_NUM_THREADS": "1", **extra}


def fit(cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "train.py"], cwd=cwd, env=env(cwd, **extra), capture_output=True, text=True, timeout=300
    )


def values(cwd: Path, name: str) -> list[tuple[tuple[int, ...], float]]:
    r = subprocess.run(
        [*hindsight_cmd(), "--home", str(cwd / ".hindsight"), "logs", name, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return [(tuple(x["ctx"].values()), x["values"][name]) for x in json.loads(r.stdout)]


def checkpoints(cwd: Path) -> list[str]:
    import hindsight as hs

    return list(hs.Store(cwd / ".hindsight" / "store").list())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    cwd = tmp_path_factory.mktemp("keras-reference")
    (cwd / "train.py").write_text(script())
    r = fit(cwd)
    assert r.returncode == 0, r.stderr[-4000:]
    return cwd, np.load(cwd / "weights.npy")


@pytest.mark.parametrize("at", ["0.0", "1.3", "2.2", "3.4"])
def test_a_fit_stopped_by_sigterm_at_any_batch_resumes_to_the_uninterrupted_weights_and_values(
    tmp_path: Path, reference: tuple[Path, np.ndarray], at: str
) -> None:
    ref, want = reference
    (tmp_path / "train.py").write_text(script())
    stopped = fit(tmp_path, SIGNAL_AT=at)
    assert stopped.returncode == 85, stopped.stderr[-4000:]
    epoch, batch = map(int, at.split("."))
    assert "SIGTERM: checkpointed keras." in stopped.stderr and "exiting with 85" in stopped.stderr
    assert not (tmp_path / "weights.npy").exists()
    resumed = fit(tmp_path, SIGNAL_AT=at)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"(epoch {epoch}, after {batch + 1} of its batches)" in resumed.stdout, resumed.stdout
    got = np.load(tmp_path / "weights.npy")
    assert np.array_equal(got, want), float(np.abs(got - want).max())
    # Each epoch's values once, equal to the uninterrupted run's (the running
    # metrics of the interrupted epoch were restored, not restarted).
    for name in ("loss", "mae", "val_loss"):
        assert values(tmp_path, name) == values(ref, name), name


def test_an_epoch_end_checkpoint_resumes_at_the_next_epoch(tmp_path: Path, reference: tuple[Path, np.ndarray]) -> None:
    """A signal in an epoch's last batch: the epoch's end decides, and the
    resume starts the next epoch with the RNG state the epoch ended with."""
    _, want = reference
    (tmp_path / "train.py").write_text(script())
    assert fit(tmp_path, SIGNAL_AT="1.5").returncode == 85  # 6 training batches per epoch (validation_split)
    resumed = fit(tmp_path, SIGNAL_AT="1.5")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "(epoch 2)" in resumed.stdout, resumed.stdout
    assert np.array_equal(np.load(tmp_path / "weights.npy"), want)


def test_retention_keeps_the_newest_checkpoints_and_a_finished_fit_starts_afresh(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(script(keep_last=2, every_steps=4))
    first = fit(tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    names = checkpoints(tmp_path)
    kept = [n for n in names if ".epoch-" in n and not n.endswith(".end")]
    assert len(kept) == 2 and kept[-1].endswith("epoch-000003"), names
    # The run finished: the same command trains again, afresh, as a new run.
    again = fit(tmp_path)
    assert again.returncode == 0 and "resuming" not in again.stdout, again.stdout
    runs = {n.split(".")[1] for n in checkpoints(tmp_path)}
    assert len(runs) == 2, checkpoints(tmp_path)


def test_an_epoch_probe_added_afterwards_replays_to_the_values_a_recording_with_it_logs(
    tmp_path: Path, reference: tuple[Path, np.ndarray]
) -> None:
    ref, _ = reference
    probed = script().replace("pass  # zoo: epoch-probe", PROBE)
    truth = tmp_path / "truth"
    truth.mkdir()
    (truth / "train.py").write_text(probed)
    assert fit(truth).returncode == 0
    proj = tmp_path / "proj"
    shutil.copytree(ref, proj)
    (proj / "train.py").write_text(probed)
    r = subprocess.run(
        [*hindsight_cmd(), "replay", "train.py", "-j", "2"],
        cwd=proj,
        env=env(proj),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "1 restored from checkpoints" in r.stdout, r.stdout
    got = values(proj, "w_sum")
    assert len(got) == 4 and got == values(truth, "w_sum"), (got, values(truth, "w_sum"))


def test_a_replay_that_trains_differently_stops_naming_the_difference(
    tmp_path: Path, reference: tuple[Path, np.ndarray]
) -> None:
    ref, _ = reference
    proj = tmp_path / "proj"
    shutil.copytree(ref, proj)
    (proj / "train.py").write_text(script().replace("pass  # zoo: epoch-probe", PROBE))
    r = subprocess.run(
        [*hindsight_cmd(), "replay", "train.py"],
        cwd=proj,
        env=env(proj, LR="2e-2"),  # trains with another learning rate than the recording
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 3, out[-4000:]
    # Caught at the first epoch's end: its weights against the checkpoint, or its values.
    assert "diverged from the recording" in out, out[-3000:]
    assert "after epoch 0, the state differs from the recorded checkpoint" in out or "loss at epoch=0" in out, out
    assert "values of w_sum: discarded" in out, out[-3000:]


def test_steps_per_execution_and_a_checkpoint_of_another_model_are_refused_naming_why(
    tmp_path: Path, reference: tuple[Path, np.ndarray]
) -> None:
    (tmp_path / "train.py").write_text(script(steps_per_execution=2))
    r = fit(tmp_path)
    assert r.returncode != 0 and "steps_per_execution" in r.stderr, r.stderr[-2000:]
    # A second fit in the same process would log its epochs over the first one's.
    twice = tmp_path / "twice"
    twice.mkdir()
    (twice / "train.py").write_text(
        script() + "model.fit(x, y, epochs=1, verbose=0, callbacks=[HindsightCallback()])\n"
    )
    r = fit(twice)
    assert r.returncode != 0 and "records one fit() per process" in r.stderr, r.stderr[-2000:]
    assert (twice / "weights.npy").exists()  # the first fit ran to its end
    # A run stopped mid-fit, relaunched with a wider layer: nothing is trained on a half-restored model.
    (tmp_path / "train.py").write_text(script())
    assert fit(tmp_path, SIGNAL_AT="1.2").returncode == 85
    (tmp_path / "train.py").write_text(script())
    wider = (tmp_path / "train.py").read_text().replace("Dense(16,", "Dense(24,")
    (tmp_path / "train.py").write_text(wider)
    r = fit(tmp_path, SIGNAL_AT="1.2")
    assert r.returncode != 0, r.stderr[-2000:]
    assert "hidden/kernel" in r.stderr and "shape" in r.stderr, r.stderr[-2000:]


PYDATASET = """\
import os, signal
os.environ["KERAS_BACKEND"] = "torch"
import numpy as np, keras
from hindsight.keras import HindsightCallback

keras.utils.set_random_seed(0)


class Pairs(keras.utils.PyDataset):
    # The classic Sequence: its order is its own state, reshuffled at each epoch's end.
    def __init__(self):
        super().__init__()
        rs = np.random.RandomState(0)
        self.x = rs.randn(256, 8).astype("float32")
        self.y = self.x[:, :1] * 2
        self.order = np.arange(256)

    def __len__(self):
        return 8

    def __getitem__(self, i):
        idx = self.order[i * 32:(i + 1) * 32]
        return self.x[idx], self.y[idx]

    def on_epoch_end(self):
        np.random.shuffle(self.order)


class Kill(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 2 and batch == 3 and not os.path.exists("signalled"):
            open("signalled", "w").close()
            os.kill(os.getpid(), signal.SIGTERM)


model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
model.fit(Pairs(), epochs=3, verbose=0, callbacks=[Kill(), HindsightCallback(every_n_train_steps=2)])
"""


def test_a_resume_whose_data_order_is_not_reproduced_stops_before_training_naming_the_batch(tmp_path: Path) -> None:
    """A PyDataset that reshuffles its own index in on_epoch_end: a process
    resumed in epoch 2 gets another order than the interrupted one (its
    dataset reshuffled twice there, never here). The skipped batches'
    fingerprints differ from the recorded ones: the resume stops, naming
    the batch and why, instead of training on other data with exit 0."""
    (tmp_path / "train.py").write_text(PYDATASET)
    assert fit(tmp_path).returncode == 85
    r = fit(tmp_path)
    assert r.returncode != 0, r.stdout + r.stderr[-3000:]
    assert "batch 0 of epoch 2 is not the batch the interrupted fit trained there" in r.stderr, r.stderr[-3000:]

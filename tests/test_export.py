"""`hindsight plot` and `hindsight export --tensorboard` on real recorded runs:
the event files are read back with TensorBoard's own reader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from test_replay import env_for, make_project

from conftest import hindsight_cmd

EPOCHS, BATCHES = 3, 4


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("export")
    script = make_project(root / "proj")
    home = root / "proj" / ".hindsight"
    for lr in ("0.01", "0.05"):
        r = subprocess.run(
            [sys.executable, str(script), "--epochs", str(EPOCHS), "--batches", str(BATCHES), "--lr", lr],
            env=env_for(home),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=script.parent,
        )
        assert r.returncode == 0, r.stderr
    from hindsight import _native

    runs = [r.id for r in _native.LogDb(str(home / "logs.db")).runs()]
    return home, sorted(runs)


def cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*hindsight_cmd(), "--home", str(home), *args], capture_output=True, text=True, timeout=300)


def logged(home: Path, run: str, name: str) -> list[tuple[tuple[tuple[str, int], ...], float]]:
    from hindsight import _native

    db = _native.LogDb(str(home / "logs.db"))
    return [(tuple(v.ctx), float(v.value_json)) for v in db.values(run, [name])]


def test_tensorboard_export_reads_back_with_tensorboards_reader(two_runs, tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    home, runs = two_runs
    out = tmp_path / "tb"
    r = cli(home, "export", "loss", "val_acc", "--run", runs[0], "--run", runs[1], "--tensorboard", str(out))
    assert r.returncode == 0, r.stderr
    for run in runs:
        acc = event_accumulator.EventAccumulator(str(out / run))
        acc.Reload()
        assert set(acc.Tags()["scalars"]) == {"loss", "val_acc"}
        loss = [(e.step, e.value) for e in acc.Scalars("loss")]
        want = sorted(logged(home, run, "loss"))
        # one point per step, on the global step axis, float32 as TensorBoard stores
        assert [s for s, _ in loss] == list(range(EPOCHS * BATCHES))
        assert [v for _, v in loss] == pytest.approx([v for _, v in want], rel=1e-6)
        # epoch values sit at the last step of their epoch, so both series line up
        val = [(e.step, e.value) for e in acc.Scalars("val_acc")]
        assert [s for s, _ in val] == [(e + 1) * BATCHES - 1 for e in range(EPOCHS)]
        assert [v for _, v in val] == pytest.approx([v for _, v in sorted(logged(home, run, "val_acc"))], rel=1e-6)
        assert acc.Scalars("loss")[0].wall_time > 1.7e9  # when the run wrote it, not when exported


def test_plot_writes_one_figure_for_several_runs(two_runs, tmp_path):
    pytest.importorskip("matplotlib")
    home, runs = two_runs
    out = tmp_path / "fig.png"
    r = cli(home, "plot", "loss", "val_acc", "--run", runs[0], "--run", runs[1], "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from hindsight import _export, _native

    db = _native.LogDb(str(home / "logs.db"))
    series = [_export.run_series(db, run, ["loss", "val_acc"]) for run in runs]
    # the legend names the runs by the argument that differs
    assert _export._differing_args(series) == ["lr"]
    assert series[0].x_label == "step (epoch × step)"


def test_unknown_names_and_runs_are_clear_errors(two_runs, tmp_path):
    home, _ = two_runs
    r = cli(home, "plot", "loss", "nope", "-o", str(tmp_path / "x.png"))
    assert r.returncode == 1
    assert "logged no 'nope' (it logged: loss, val_acc)" in r.stderr
    assert not (tmp_path / "x.png").exists()
    r = cli(home, "export", "loss", "--run", "20000101-000000-abcdef", "--tensorboard", str(tmp_path / "tb"))
    assert r.returncode == 1 and "20000101-000000-abcdef" in r.stderr
    r = cli(home, "plot", "loss")
    assert r.returncode == 2 and "-o" in r.stderr

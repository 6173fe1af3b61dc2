"""Arguments recorded by `hs.arg`: every value a script can pass or a command
line can give is recorded, and the engine's one JSON rule accepts them all
(NaN and infinities included, as `hs.log` always did)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from conftest import hindsight_cmd

SCRIPT = """
import json, sys
import numpy as np
import hindsight as hs
out = {
    "nan_default": hs.arg("nan_default", float("nan")),
    "max_grad_norm": hs.arg("max_grad_norm", float("inf")),
    "wd": hs.arg("wd", 0.5),
    "clip": hs.arg("clip", 1.0),
}
lr = hs.arg("lr", np.float32(0.1))
steps = hs.arg("steps", np.int64(7))
print(json.dumps({"types": [type(lr).__name__, type(steps).__name__],
                  "values": {k: repr(v) for k, v in out.items()}}))
"""


def test_nan_inf_and_numpy_scalars_are_recorded(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    home = tmp_path / "home"
    env = {**os.environ, "HINDSIGHT_HOME": str(home)}
    r = subprocess.run(
        [sys.executable, str(script), "--wd", "nan", "--clip=-inf"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    printed = json.loads(r.stdout)
    # The script gets its values back with their own types.
    assert printed["types"] == ["float32", "int64"]
    assert printed["values"] == {"nan_default": "nan", "max_grad_norm": "inf", "wd": "nan", "clip": "-inf"}

    from hindsight import _native

    (run,) = _native.LogDb(str(home / "logs.db")).runs()
    args = json.loads(run.args_json)
    assert math.isnan(args["nan_default"]) and math.isnan(args["wd"])
    assert args["max_grad_norm"] == math.inf and args["clip"] == -math.inf
    assert args["lr"] == float(__import__("numpy").float32(0.1)) and args["steps"] == 7
    # The CLI shows such a run.
    show = subprocess.run(
        [*hindsight_cmd(), "--home", str(home), "show", run.id], capture_output=True, text=True, timeout=60
    )
    assert show.returncode == 0, show.stderr
    assert "NaN" in show.stdout and "Infinity" in show.stdout


def test_unrecordable_argument_is_refused_with_its_name(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text("import hindsight as hs\nhs.arg('model', object())\n")
    r = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HINDSIGHT_HOME": str(tmp_path / "home")},
    )
    assert r.returncode != 0
    assert "hs.arg('model')" in r.stderr and "object" in r.stderr


ARG_SCRIPT = """
import json, hindsight as hs
print(json.dumps({"layers": hs.arg("layers", [64, 64]), "name": hs.arg("name", None), "lr": hs.arg("lr", 0.1)}))
"""


def _run_script(tmp_path: Path, text: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run `text` as a script in its own project home."""
    script = tmp_path / "script.py"
    script.write_text(text)
    env = {**os.environ, "HINDSIGHT_HOME": str(tmp_path / "home")}
    return subprocess.run([sys.executable, str(script), *argv], env=env, capture_output=True, text=True, timeout=120)


def _run_args(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return _run_script(tmp_path, ARG_SCRIPT, *argv)


def test_list_and_none_defaults_take_json_of_their_kind(tmp_path: Path) -> None:
    r = _run_args(tmp_path, "--layers", "[128, 32]", "--name", "resnet")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"layers": [128, 32], "name": "resnet", "lr": 0.1}
    bad = _run_args(tmp_path, "--layers", '{"a": 1}')
    assert bad.returncode != 0 and "--layers" in bad.stderr and "list" in bad.stderr


def test_a_flag_without_its_value_is_an_error(tmp_path: Path) -> None:
    r = _run_args(tmp_path, "--lr")
    assert r.returncode != 0 and "--lr" in r.stderr and "expected a value" in r.stderr


FLAG_SCRIPT = """
import json, hindsight as hs
dry = hs.arg("dry_run", False)
lr = hs.arg("lr", 0.1)
for epoch in hs.loop("epoch", range(1)):
    pass
print(json.dumps({"dry_run": dry, "lr": lr}))
"""


def _run_flags(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return _run_script(tmp_path, FLAG_SCRIPT, *argv)


def test_bare_boolean_flags(tmp_path: Path) -> None:
    r = _run_flags(tmp_path, "--dry_run", "--lr", "0.5")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"dry_run": True, "lr": 0.5}
    r = _run_flags(tmp_path, "--lr", "0.5", "--dry_run")
    assert json.loads(r.stdout) == {"dry_run": True, "lr": 0.5}
    r = _run_flags(tmp_path, "--dry_run", "false")
    assert json.loads(r.stdout) == {"dry_run": False, "lr": 0.1}


def _runs(tmp_path: Path) -> list[dict[str, object]]:
    r = subprocess.run(
        [*hindsight_cmd(), "--home", str(tmp_path / "home"), "runs", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    runs: list[dict[str, object]] = json.loads(r.stdout)
    return runs


def test_a_misspelt_flag_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    r = _run_flags(tmp_path, "--lrr", "3")
    assert r.returncode != 0
    assert "unknown argument --lrr; did you mean --lr?" in r.stderr
    assert "--dry_run, --lr" in r.stderr
    # Refused command lines leave no failed run behind to become "the latest".
    for argv in (["--lr"], ["--lr", "x"]):
        r = _run_flags(tmp_path, *argv)
        assert r.returncode != 0 and "--lr" in r.stderr
    assert _runs(tmp_path) == []
    assert _run_flags(tmp_path, "--lr", "0.5").returncode == 0
    assert [run["status"] for run in _runs(tmp_path)] == ["completed"]


def test_help_lists_the_arguments(tmp_path: Path) -> None:
    r = _run_flags(tmp_path, "--help")
    assert r.returncode == 0, r.stderr
    assert "--lr FLOAT  (default: 0.1)" in r.stdout and "--dry_run BOOL" in r.stdout


ARGPARSE_SCRIPT = """
import argparse, json, hindsight as hs
p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, nargs="+", default=[64])
p.add_argument("--name", default=None)
ns = hs.args(p)
wd = hs.arg("wd", 0.0)
for epoch in hs.loop("epoch", range(1)):
    pass
print(json.dumps({"layers": ns.layers, "name": ns.name, "wd": wd}))
"""


def test_an_argparse_parser_is_recorded_and_its_flags_are_known(tmp_path: Path) -> None:
    script = tmp_path / "ap.py"
    script.write_text(ARGPARSE_SCRIPT)
    home = tmp_path / "home"
    env = {**os.environ, "HINDSIGHT_HOME": str(home)}
    r = subprocess.run(
        [sys.executable, str(script), "--layers", "8", "16", "--wd", "0.5", "--name", "x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"layers": [8, 16], "name": "x", "wd": 0.5}
    runs = subprocess.run([*hindsight_cmd(), "--home", str(home), "runs", "--json"], capture_output=True, text=True)
    [run] = json.loads(runs.stdout)
    assert run["args"] == {"layers": [8, 16], "name": "x", "wd": 0.5}


REPLAY_ARGPARSE = """
import argparse
import hindsight as hs
p = argparse.ArgumentParser()
p.add_argument("total_epochs", type=int)
p.add_argument("--dataset", required=True)
p.add_argument("--flag", action="store_true")
p.add_argument("--layers", nargs="+", type=int, default=[1])
sub = p.add_subparsers(dest="cmd", required=True)
sub.add_parser("train").add_argument("--lr", type=float, default=0.1)
ns = hs.args(p)
w = 0.0
for epoch in hs.loop("epoch", range(ns.total_epochs)):
    w += ns.lr * sum(ns.layers)
    hs.log("w", w)
"""


def test_a_parser_with_required_positional_and_subcommand_arguments_replays(tmp_path: Path) -> None:
    """The pytorch/examples shapes (dcgan's required `--dataset`, the DDP
    tutorial's positionals): replay parses what the recording was given."""
    script = tmp_path / "train.py"
    script.write_text(REPLAY_ARGPARSE)
    home = tmp_path / "home"
    env = {**os.environ, "HINDSIGHT_HOME": str(home), "HINDSIGHT_CHECKPOINT_EVERY": "1"}
    argv = ["--layers", "8", "16", "--flag", "3", "--dataset", "cifar", "train", "--lr", "0.5"]
    r = subprocess.run([sys.executable, str(script), *argv], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    script.write_text(
        REPLAY_ARGPARSE.replace(
            '    hs.log("w", w)\n',
            '    hs.log("w", w)\n    hs.log("cfg", f"{ns.dataset}|{ns.flag}|{ns.layers}|{ns.cmd}")\n',
        )
    )
    r = subprocess.run(
        [*hindsight_cmd(), "replay", str(script), "-q"], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    code = (
        "import json, hindsight as hs\nprint(hs.dataframe('w', 'cfg')[['epoch', 'w', 'cfg']].to_json(orient='values'))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[e, 12.0 * (e + 1), "cifar|True|[8, 16]|train"] for e in range(3)]
    # A mistyped name is an error naming the logged ones, as `hindsight logs` says.
    typo = subprocess.run(
        [sys.executable, "-c", "import hindsight as hs; hs.dataframe('w', 'cgf')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert typo.returncode == 1
    assert "NotFoundError" in typo.stderr and "never logged 'cgf' (it logged: w, cfg)" in typo.stderr


HELPFUL = """
import argparse, hindsight as hs
p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, required=True)
args = hs.args(p)
for e in hs.loop("epoch", range(args.epochs)):
    hs.log("e", e)
"""


def test_help_and_a_refused_command_line_create_no_run(tmp_path: Path) -> None:
    """Issue 22: `python train.py --help` left a completed run with no
    iterations, which became "the latest run" that replay then failed on."""
    for argv, code in ((["--help"], 0), ([], 2), (["--epochs", "x"], 2)):
        r = _run_script(tmp_path, HELPFUL, *argv)
        assert r.returncode == code, r.stderr
    assert _runs(tmp_path) == []
    r = _run_script(tmp_path, HELPFUL, "--epochs", "2")
    assert r.returncode == 0, r.stderr

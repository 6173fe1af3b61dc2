"""The HINDSIGHT_* environment variables have one owner (core `settings`):
every one the package, the engine or the README uses is in its table, and a
value that does not parse stops the run before training, naming it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hindsight import _native

from conftest import REPO

NAME = re.compile(r"HINDSIGHT_[A-Z][A-Z_]*[A-Z]")


def test_every_variable_used_anywhere_is_in_the_engines_table() -> None:
    known = {s.name for s in _native.settings()}
    sources = [
        *(REPO / "python" / "hindsight").rglob("*.py"),
        *(p for p in (REPO / "crates").rglob("*.rs") if "tests" not in p.parts and p.name != "tests.rs"),
        REPO / "README.md",
        *(REPO / "docs").glob("*.md"),
    ]
    used: dict[str, Path] = {}
    for p in sources:
        for name in NAME.findall(p.read_text()):
            used.setdefault(name, p)
    unknown = {n: str(p.relative_to(REPO)) for n, p in used.items() if n not in known}
    assert not unknown, f"variables outside hindsight_core::settings: {unknown}"
    # Each user-facing one is documented where users look.
    readme = (REPO / "README.md").read_text() + "".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    undocumented = [s.name for s in _native.settings() if not s.internal and s.name not in readme]
    assert not undocumented, undocumented


SCRIPT = """
import torch, hindsight as hs
net = torch.nn.Linear(2, 1)
with hs.checkpointing(model=net):
    for epoch in hs.loop("epoch", range(2)):
        print("trained", epoch)
"""


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("HINDSIGHT_RESUME", "maybe", "is not a flag"),
        ("HINDSIGHT_SAFETY_MINUTES", "ten", "is not a finite number"),
        ("HINDSIGHT_EXIT_CODE", "300", "is not an exit code"),
        ("HINDSIGHT_CATCH_SIGINT", "2", "is not a flag"),
        ("HINDSIGHT_EPSILON", "junk", "give a fraction of training time"),
        ("HINDSIGHT_CHECKPOINT_EVERY", "-3", "at least 1"),
        ("HINDSIGHT_CHECKPOINT_BUDGET", "lots", "is not a size"),
    ],
)
def test_a_value_that_does_not_parse_stops_the_run_before_training_in_one_line(
    tmp_path: Path, name: str, value: str, why: str
) -> None:
    script = tmp_path / "t.py"
    script.write_text(SCRIPT)
    home = tmp_path / "home"
    env = {**os.environ, "HINDSIGHT_HOME": str(home), name: value}
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "trained" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hindsight: error: invalid ") and name in lines[0], r.stderr
    assert why in lines[0], r.stderr
    # No run was created (a later, corrected command does not "resume" it).
    runs = _native.LogDb(str(home / "logs.db")).runs() if (home / "logs.db").exists() else []
    assert runs == []


def test_a_run_name_another_command_started_is_refused_naming_the_difference(tmp_path: Path) -> None:
    """Two projects sharing a home and a run name: the second does not go on
    from the first one's checkpoints (issue 42, item 4)."""
    home = tmp_path / "home"
    stop = (
        "import os, signal, torch, hindsight as hs\n"
        "lr = hs.arg('lr', 0.1)\n"
        "net = torch.nn.Linear(2, 1)\n"
        "with hs.checkpointing(model=net):\n"
        "    for epoch in hs.loop('epoch', range(3)):\n"
        "        print('trained', epoch, flush=True)\n"
        "        if epoch == 1 and os.environ.get('STOP'):\n"
        "            os.kill(os.getpid(), signal.SIGTERM)\n"
    )
    for p in ("p1", "p2"):
        (tmp_path / p).mkdir()
        (tmp_path / p / "train.py").write_text(stop)
    env = {**os.environ, "HINDSIGHT_HOME": str(home), "HINDSIGHT_RUN_NAME": "shared", "HINDSIGHT_CHECKPOINT_EVERY": "1"}

    def run(p: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "train.py", *args],
            cwd=tmp_path / p,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
        )

    first = run("p1", "--lr", "0.1", STOP="1")
    assert first.returncode == 85, first.stderr[-2000:]
    for p, args, differs in (("p2", ["--lr", "0.1"], "p2/train.py"), ("p1", ["--lr", "0.5"], '["--lr","0.5"]')):
        r = run(p, *args)
        assert r.returncode == 2, r.stderr[-2000:]
        assert "trained" not in r.stdout
        assert "HINDSIGHT_RUN_NAME" in r.stderr and differs in r.stderr and "another command" in r.stderr, r.stderr
    # The original command still resumes it.
    again = run("p1", "--lr", "0.1")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming run" in again.stderr and "trained 2" in again.stdout


def test_setting_value_parses_by_the_engines_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    from hindsight import _settings
    from hindsight.errors import InvalidArgumentError

    monkeypatch.setenv("HINDSIGHT_REPLAY_FORK", "off")
    monkeypatch.setenv("HINDSIGHT_SAFETY_MINUTES", "0.5")
    monkeypatch.setenv("HINDSIGHT_RUN_NAME", "")
    assert _settings.flag(_settings.REPLAY_FORK, True) is False
    assert _settings.number(_settings.SAFETY_MINUTES) == 0.5
    assert _settings.text(_settings.RUN_NAME) is None  # empty is unset
    with pytest.raises(InvalidArgumentError, match="not a hindsight setting"):
        _native.setting_value("HINDSIGHT_" + "NOPE")

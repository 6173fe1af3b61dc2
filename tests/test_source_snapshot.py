"""What a recording keeps of the project's code (the replay compares the
code it runs against it): the script and the modules it imported from the
project always, the rest of the project as far as a bounded walk reaches."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from hindsight._run import common


def test_a_cut_walk_still_keeps_the_script_and_the_imported_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A project root holding far more than code (a dataset, a scratch
    directory under which the home was set) is walked only so far; what the
    run executed is kept all the same."""
    for i in range(300):
        d = tmp_path / f"data{i:03}"
        d.mkdir()
        (d / f"mod{i}.py").write_text(f"X = {i}\n")
    (tmp_path / "zz").mkdir()
    (tmp_path / "zz" / "helper_for_snapshot.py").write_text("HELP = 1\n")
    script = tmp_path / "train.py"
    script.write_text("import helper_for_snapshot\n")
    monkeypatch.setattr(common, "MAX_SOURCE_ENTRIES", 400)
    monkeypatch.syspath_prepend(str(tmp_path / "zz"))
    importlib.import_module("helper_for_snapshot")
    try:
        files = common._snapshot_source(tmp_path, script)
    finally:
        sys.modules.pop("helper_for_snapshot", None)
    assert files["train.py"] == "import helper_for_snapshot\n"
    assert files["zz/helper_for_snapshot.py"] == "HELP = 1\n"
    walked = [f for f in files if f.startswith("data")]
    assert 0 < len(walked) < 300, len(walked)


def test_a_small_project_is_kept_whole(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "model.py").write_text("M = 1\n")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "skipped.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    assert common._snapshot_source(tmp_path, script) == {"train.py": "print(1)\n", "pkg/model.py": "M = 1\n"}

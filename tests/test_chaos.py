"""The short version of `make chaos` (kill -9 loop, gc against writers,
corruption sweep, same-name saves, crafted files entries, concurrent
resumes, rogue workers): zero failures. The manifest fuzzer's short version runs
in `make test-rust` (crates/hindsight-core/tests/manifests.rs)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_quick_chaos_finds_nothing() -> None:
    r = subprocess.run(
        [sys.executable, str(REPO / "benches" / "chaos.py"), "--quick", "--no-fuzz"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    table = r.stdout[r.stdout.index("experiment") :]
    assert "kill -9" in table and "gc loop" in table and "flip / truncate / delete" in table
    assert "input service" in table
    for row in ("one name, two savers", "crafted files entries", "two resumes of one run", "rogue workers"):
        assert row in table, table

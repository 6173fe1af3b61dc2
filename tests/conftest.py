from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from s3util import prefix, s3_server  # noqa: F401  (fixtures: the loopback S3 server)
from slurmutil import slurm  # noqa: F401  (fixture: the single-node Slurm cluster)

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`cuda` tests run where a GPU is; elsewhere they are skipped, saying why."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device visible to torch")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


def run_py(
    code: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None, **kw
) -> subprocess.CompletedProcess[str]:
    """Run a Python snippet in a fresh interpreter (real process, real signals)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        **kw,
    )


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a launcher's ranks), by pid."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return sorted(out)


def hindsight_cmd() -> list[str]:
    """The `hindsight` console script installed next to this interpreter,
    else the one on PATH (a wheel installed with `pip --target`, as on the
    GPU machines, puts it in the target's bin/)."""
    exe = Path(sys.executable).parent / "hindsight"
    if not exe.exists():
        found = shutil.which("hindsight")
        assert found, f"console script missing: {exe}, and none on PATH"
        exe = Path(found)
    return [str(exe)]

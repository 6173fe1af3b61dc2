from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from azureutil import azure_server  # noqa: F401  (fixture: the loopback Azure Blob Storage server)
from xrootdutil import xrootd_server_url  # noqa: F401  (fixture: the loopback XRootD server)

import forkserver
from s3util import prefix, s3_server  # noqa: F401  (fixtures: the loopback S3 server)
from slurmutil import slurm  # noqa: F401  (fixture: the single-node Slurm cluster)

REPO = Path(__file__).resolve().parent.parent


_FORKS: forkserver.ForkServer | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--no-fork", action="store_true", help="start every test script in a fresh interpreter (tests/forkserver.py)"
    )


def pytest_configure(config: pytest.Config) -> None:
    """Scripts the tests run to completion start forked from a pre-imported
    interpreter (tests/forkserver.py says which, and when not)."""
    global _FORKS
    if config.getoption("--no-fork"):
        return
    import torch

    _FORKS = forkserver.ForkServer(default_threads=torch.get_num_threads())
    subprocess.run = forkserver.routed_run(_FORKS, subprocess.run)  # type: ignore[assignment]


_WORKER_COUNTS: list[dict[str, Any]] = []  # from pytest-xdist's workers, when they end


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _FORKS is not None and hasattr(session.config, "workeroutput"):  # an xdist worker
        session.config.workeroutput["forks"] = {
            "forked": _FORKS.forked,
            "zygotes": _FORKS.started,
            "fresh": _FORKS.fresh,
        }


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    if "forks" in getattr(node, "workeroutput", {}):
        _WORKER_COUNTS.append(node.workeroutput["forks"])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many scripts started forked, and why the others started afresh."""
    mine = {"forked": _FORKS.forked, "zygotes": _FORKS.started, "fresh": _FORKS.fresh} if _FORKS else None
    counts = [*_WORKER_COUNTS, *([mine] if mine else [])]
    if not counts:
        return
    fresh: dict[str, int] = {}
    for c in counts:
        for why, n in c["fresh"].items():
            fresh[why] = fresh.get(why, 0) + n
    listed = ", ".join(f"{n} ({why})" for why, n in sorted(fresh.items(), key=lambda kv: -kv[1]))
    forked, zygotes = sum(c["forked"] for c in counts), sum(c["zygotes"] for c in counts)
    terminalreporter.write_line(f"forked scripts: {forked} (from {zygotes} zygotes); fresh interpreters: {listed or 0}")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _FORKS is not None:
        _FORKS.close()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked `fresh_process` starts every subprocess.run interpreter
    afresh, its module fixtures included (they are set up after this)."""
    if _FORKS is not None:
        _FORKS.enabled = item.get_closest_marker("fresh_process") is None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under `-n 2 --dist loadgroup` (make test), a test file runs on one
    worker (its module fixtures, such as a reference recording, are made
    once), and every test on the Slurm cluster on one worker (one cluster).
    `cuda` tests run where a GPU is; elsewhere they are skipped, saying why."""
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            group = "slurm" if item.get_closest_marker("slurm") else item.path.stem
            item.add_marker(pytest.mark.xdist_group(group))
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


@pytest.fixture(params=["s3", "az", "root"])
def object_url(request: pytest.FixtureRequest) -> str:
    """A fresh, empty location on each object store server (moto for s3://,
    Azurite for az://, xrootd for root://): the tests that take it pass on
    every backend."""
    import uuid

    import azureutil

    import s3util

    unique = f"{request.node.originalname}-{uuid.uuid4().hex[:8]}"
    if request.param == "s3":
        request.getfixturevalue("s3_server")
        return s3util.url_of(unique)
    if request.param == "root":
        return f"{request.getfixturevalue('xrootd_server_url')}//tests/{unique}"
    request.getfixturevalue("azure_server")
    return f"az://{azureutil.CONTAINER}/{unique}"

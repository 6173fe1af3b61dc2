"""A real Azure Blob Storage protocol server for the tests: Azurite's blob
service (npm `azurite`, installed by `make azurite`) in its own process on
loopback, in memory, with one container; the AZURE_STORAGE_* variables point
at it while it runs."""

from __future__ import annotations

import base64
import contextlib
import email.utils
import hashlib
import hmac
import os
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import loopback

CONTAINER = "hindsight-test"
# Azurite's one account: its name and key are public, fixed by Azurite.
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
#: Where `make azurite` installs it (the Makefile's AZURITE_DIR).
AZURITE_DIR = Path(os.environ.get("HINDSIGHT_AZURITE_DIR", Path.home() / ".cache" / "hindsight" / "azurite"))


def azurite_bin() -> str | None:
    """The azurite-blob executable, if installed."""
    local = AZURITE_DIR / "node_modules" / ".bin" / "azurite-blob"
    return str(local) if local.exists() else shutil.which("azurite-blob")


def env_for(endpoint: str) -> dict[str, str]:
    """The variables a client reads to reach Azurite at `endpoint`."""
    return {"AZURE_STORAGE_USE_EMULATOR": "true", "AZURITE_BLOB_STORAGE_URL": endpoint}


def create_container(endpoint: str, name: str) -> None:
    """PUT a container, signed with Azurite's account key (Shared Key)."""
    date = email.utils.formatdate(usegmt=True)
    version = "2021-08-06"
    to_sign = "\n".join(
        [
            "PUT",
            *[""] * 4,  # Content-Encoding, -Language, -Length (0 is signed empty), -MD5
            "application/octet-stream",  # Content-Type (urllib would send its own)
            *[""] * 6,  # Date (x-ms-date instead), conditions, Range
            f"x-ms-date:{date}",
            f"x-ms-version:{version}",
            f"/{ACCOUNT}/{ACCOUNT}/{name}",
            "restype:container",
        ]
    )
    sig = base64.b64encode(hmac.new(base64.b64decode(ACCOUNT_KEY), to_sign.encode(), hashlib.sha256).digest())
    req = urllib.request.Request(
        f"{endpoint}/{ACCOUNT}/{name}?restype=container",
        method="PUT",
        data=b"",
        headers={
            "x-ms-date": date,
            "x-ms-version": version,
            "Content-Type": "application/octet-stream",
            "Authorization": f"SharedKey {ACCOUNT}:{sig.decode()}",
        },
    )
    try:
        urllib.request.urlopen(req, timeout=10).close()
    except urllib.error.HTTPError as e:
        if e.code != 409:  # already there
            raise RuntimeError(f"Azurite refused to create container {name}: {e.code} {e.read()[:500]!r}") from e


@contextlib.contextmanager
def azurite_server(log_path: str) -> Iterator[str]:
    """Azurite's blob service on a free loopback port, in memory; yields its endpoint."""
    exe = azurite_bin()
    if exe is None:
        raise FileNotFoundError("azurite-blob is not installed: run `make azurite`")
    port = loopback.free_port()
    argv = [exe, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence", "--skipApiVersionCheck"]
    with loopback.server(
        argv, log_path, lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close(), "Azurite"
    ):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Azurite on loopback with one container; AZURE_STORAGE_* point at it."""
    if azurite_bin() is None:
        pytest.skip("Azurite is not installed (make azurite)")
    with azurite_server(str(tmp_path_factory.mktemp("azurite") / "server.log")) as endpoint:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env_for(endpoint).items():
                mp.setenv(k, v)
            create_container(endpoint, CONTAINER)
            yield endpoint


def main(argv: list[str]) -> int:
    """`python tests/azureutil.py -- CMD...`: run CMD with Azurite on loopback,
    one container, the AZURE_STORAGE_* variables and HINDSIGHT_TEST_AZURE_URL
    pointing at it (used by `make test-rust` for the storage conformance suite)."""
    import tempfile

    if argv[:1] != ["--"] or len(argv) < 2:
        print("usage: azureutil.py -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp, azurite_server(os.path.join(tmp, "server.log")) as endpoint:
        create_container(endpoint, CONTAINER)
        env = {**os.environ, **env_for(endpoint)}
        env["HINDSIGHT_TEST_AZURE_URL"] = f"az://{CONTAINER}/conformance-{uuid.uuid4().hex[:8]}"
        return subprocess.run(argv[1:], env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

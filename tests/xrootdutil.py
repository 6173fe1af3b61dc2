"""A real XRootD server for the tests: Debian's `xrootd` (installed by
`make xrootd`) in its own process on a free port, serving a fresh directory.
Closed like a site's: it takes connections from loopback only
(`xrd.allow`) and authenticates every one with a shared-secret key (sss),
which the client finds through `XrdSecSSSKT` while the server runs."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import loopback

#: The daemon refuses to run as root; Debian's package creates this user.
SERVER_USER = "xrootd"


def installed() -> bool:
    return all(shutil.which(t) for t in ("xrootd", "xrdcp", "xrdfs", "xrdsssadmin"))


def _owned_by(path: Path, user: str | None, mode: int) -> None:
    if user is not None:
        pw = pwd.getpwnam(user)
        os.chown(path, pw.pw_uid, pw.pw_gid)
    path.chmod(mode)


def _keytab(path: Path) -> None:
    """A new sss key for the current user."""
    me = pwd.getpwuid(os.getuid()).pw_name
    r = subprocess.run(
        ["xrdsssadmin", "-k", "hindsight-test", "-u", me, "-g", me, "add", str(path)],
        input="y\n",
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0 or not path.exists():
        raise RuntimeError(f"xrdsssadmin could not make a key in {path}: {r.stdout}{r.stderr}")


def env_for(keytab: Path) -> dict[str, str]:
    """The variables the XRootD client reads to authenticate to the server.
    The client also reverse-resolves the host's own addresses at each start;
    where the DNS server drops a query that waits out the resolver's 5 s
    timeout, so the tests wait 1 s at most (RES_OPTIONS, read by glibc)."""
    return {"XrdSecSSSKT": str(keytab), "XrdSecPROTOCOL": "sss", "RES_OPTIONS": "timeout:1 attempts:1"}


@contextlib.contextmanager
def xrootd_server() -> Iterator[tuple[str, dict[str, str]]]:
    """An xrootd on a free port serving a fresh directory; yields its
    `root://127.0.0.1:PORT` and the client's variables."""
    if not installed():
        raise FileNotFoundError("the XRootD server and client are not installed: run `make xrootd`")
    # Not under pytest's tmp dirs: those are private to root, and the daemon
    # runs as its own user.
    top = Path(tempfile.mkdtemp(prefix="hindsight-xrootd-"))
    try:
        user = SERVER_USER if os.getuid() == 0 else None
        top.chmod(0o755)
        data, admin = top / "data", top / "admin"
        for d in (data, admin):
            d.mkdir()
            _owned_by(d, user, 0o755)
        server_key, client_key = top / "server.keytab", top / "client.keytab"
        _keytab(client_key)
        shutil.copyfile(client_key, server_key)
        _owned_by(client_key, None, 0o600)
        _owned_by(server_key, user, 0o600)
        port = loopback.free_port()
        config = top / "xrootd.cfg"
        config.write_text(
            "\n".join(
                [
                    "all.export /",
                    f"oss.localroot {data}",
                    f"all.adminpath {admin}",
                    f"all.pidpath {admin}",
                    "xrd.allow host localhost",
                    "xrd.allow host 127.0.0.1",
                    "xrootd.seclib libXrdSec.so",
                    f"sec.protocol sss -s {server_key}",
                    "sec.protbind * only sss",
                    "",
                ]
            )
        )
        config.chmod(0o644)
        argv = ["xrootd", "-c", str(config), "-p", str(port), "-n", f"hs{port}"]
        if user is not None:
            argv += ["-R", user]
        with loopback.server(
            argv,
            str(top / "server.log"),
            lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close(),
            "xrootd",
        ):
            yield f"root://127.0.0.1:{port}", env_for(client_key)
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="session")
def xrootd_server_url() -> Iterator[str]:
    """xrootd on loopback; the sss variables point the client at its key."""
    if not installed():
        pytest.skip("XRootD is not installed (make xrootd)")
    with xrootd_server() as (url, env):
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            yield url


def main(argv: list[str]) -> int:
    """`python tests/xrootdutil.py -- CMD...`: run CMD with an xrootd on
    loopback, HINDSIGHT_TEST_XROOTD_URL and the sss variables pointing at it
    (used by `make test-rust` for the storage conformance suite)."""
    if argv[:1] != ["--"] or len(argv) < 2:
        print("usage: xrootdutil.py -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    with xrootd_server() as (url, env):
        env = {**os.environ, **env}
        env["HINDSIGHT_TEST_XROOTD_URL"] = f"{url}//conformance-{uuid.uuid4().hex[:8]}"
        return subprocess.run(argv[1:], env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

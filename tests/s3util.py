"""A real S3-protocol server for the tests: moto's server in its own process
on loopback, with one bucket; the AWS_* variables point at it while it runs."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import loopback

BUCKET = "hindsight-test"


ENV_VARS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


@contextlib.contextmanager
def moto_server(log_path: str) -> Iterator[str]:
    """moto's S3 server in its own process on a free loopback port; yields its endpoint."""
    port = loopback.free_port()
    endpoint = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with loopback.server(argv, log_path, lambda: urllib.request.urlopen(endpoint + "/", timeout=1).close(), "moto"):
        yield endpoint


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server on loopback with one bucket; AWS_* variables point at it."""
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("boto3") is None:
        pytest.skip("moto[server] is not installed (see requirements-dev.txt)")
    with moto_server(str(tmp_path_factory.mktemp("moto") / "server.log")) as endpoint:
        with pytest.MonkeyPatch.context() as mp:
            for var in ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
                mp.delenv(var, raising=False)
            mp.setenv("AWS_ENDPOINT_URL", endpoint)
            for k, v in ENV_VARS.items():
                mp.setenv(k, v)
            s3().create_bucket(Bucket=BUCKET)
            yield endpoint


def s3() -> Any:
    """A boto3 client for the server the AWS_* variables name."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=os.environ["AWS_ENDPOINT_URL"],
        aws_access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region_name=os.environ["AWS_REGION"],
    )


@pytest.fixture
def prefix(s3_server: str, request: pytest.FixtureRequest) -> str:
    """A fresh key prefix of its own for each test."""
    return f"{request.node.name}-{uuid.uuid4().hex[:8]}"


def url_of(prefix: str) -> str:
    return f"s3://{BUCKET}/{prefix}"


def keys(prefix: str, sub: str) -> list[str]:
    out = []
    full = f"{prefix}/{sub}/" if sub else f"{prefix}/"
    for page in s3().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=full):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out


def main(argv: list[str]) -> int:
    """`python tests/s3util.py -- CMD...`: run CMD with a loopback S3 server, one
    bucket, the AWS_* variables and HINDSIGHT_TEST_S3_URL pointing at it (used
    by `make test-rust` for the Rust storage conformance suite)."""
    import tempfile

    if argv[:1] != ["--"] or len(argv) < 2:
        print("usage: s3util.py -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp, moto_server(os.path.join(tmp, "server.log")) as endpoint:
        env = {
            k: v for k, v in os.environ.items() if k not in ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE")
        }
        env.update(
            ENV_VARS,
            AWS_ENDPOINT_URL=endpoint,
            HINDSIGHT_TEST_S3_URL=f"s3://{BUCKET}/conformance-{uuid.uuid4().hex[:8]}",
        )
        os.environ.update(env)
        s3().create_bucket(Bucket=BUCKET)
        return subprocess.run(argv[1:], env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

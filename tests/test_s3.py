"""Stores on S3-compatible object storage, against a real S3 protocol server
(moto, a separate process on loopback): round trip, dedup, gc, crash safety,
corruption, and the Rust storage conformance suite."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("moto") is None or importlib.util.find_spec("boto3") is None:
    pytest.skip("moto[server] is not installed (see requirements-dev.txt)", allow_module_level=True)

import boto3
import numpy as np
import torch

import hindsight as hs

REPO = Path(__file__).resolve().parent.parent
BUCKET = "hindsight-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server on loopback with one bucket; AWS_* variables point at it."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint + "/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start (see {log.name})") from None
                time.sleep(0.1)
        with pytest.MonkeyPatch.context() as mp:
            for var in ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
                mp.delenv(var, raising=False)
            mp.setenv("AWS_ENDPOINT_URL", endpoint)
            mp.setenv("AWS_ACCESS_KEY_ID", "testing")
            mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            mp.setenv("AWS_REGION", "us-east-1")
            s3().create_bucket(Bucket=BUCKET)
            yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def s3():
    """A boto3 client for the server the AWS_* variables name."""
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


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads included)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def state_dict(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    nan_payload = torch.tensor([0x7FF8_0000_0000_1234, 0x7FF0_0000_0000_0000], dtype=torch.int64).view(torch.float64)
    return {
        "model": {
            "emb.weight": torch.randn(3 << 20, generator=g),  # 12 MiB: several chunks
            "fc.weight": torch.randn(64, 33, generator=g).to(torch.bfloat16),
            "fc.bias": torch.randn(33, generator=g).half(),
            "steps": torch.arange(-5, 1000, dtype=torch.int64),
            "mask": torch.rand(999, generator=g) > 0.5,
            "q": torch.randint(-128, 127, (17, 3), generator=g, dtype=torch.int8),
            "odd": nan_payload,
            "empty": torch.empty(0, 4),
        },
        "optim": {"step": 7, "lr": 0.1, "betas": (0.9, 0.999), "name": "adam", "none": None},
    }


def assert_same_state(got: dict, want: dict) -> None:
    assert got["optim"] == want["optim"]
    assert list(got["model"]) == list(want["model"])
    for k, t in want["model"].items():
        assert same(got["model"][k], t), k


def test_round_trip_list_and_reopen(prefix):
    url = url_of(prefix)
    with pytest.raises(hs.NotFoundError, match=prefix):
        hs.Store(url, create=False)
    want = state_dict(1)
    with hs.Store(url) as store:
        assert store.path == url
        store.save("epoch-1", want, meta={"loss": 0.5}).wait()
        store.save("epoch-0", state_dict(0)).wait()
        assert store.list() == ["epoch-0", "epoch-1"]
        assert_same_state(store.load("epoch-1"), want)
        assert store.info("epoch-1")["meta"] == {"loss": "0.5"}
        assert same(store.load("epoch-1", path="model/fc.weight"), want["model"]["fc.weight"])
    # The layout a local store has, under the prefix; no lease left behind.
    assert f"{prefix}/HINDSIGHT.json" in keys(prefix, "")
    assert sorted(keys(prefix, "manifests")) == [f"{prefix}/manifests/epoch-0.hsm", f"{prefix}/manifests/epoch-1.hsm"]
    assert keys(prefix, "locks") == []
    # Another Store (as another process would) sees the same checkpoints.
    with hs.Store(url, create=False) as again:
        assert again.list() == ["epoch-0", "epoch-1"]
        assert_same_state(again.load("epoch-1"), want)
        assert again.verify() == []
        with pytest.raises(hs.NotFoundError, match="epoch-9"):
            again.load("epoch-9")
        with pytest.raises(hs.InvalidArgumentError, match="fixed at creation"):
            hs.Store(url, chunk_size=1 << 20)


def test_second_save_of_same_state_writes_no_chunks(prefix):
    url = url_of(prefix)
    state = state_dict(2)
    with hs.Store(url) as store:
        first = store.save("a", state).wait()
        assert first["chunks_written"] > 0
        n = len(keys(prefix, "chunks"))
        assert n == first["chunks_written"]
        # Content-addressed: the same bytes again are found in the bucket, not re-uploaded.
        second = store.save("b", state, skip_unchanged=False).wait()
        assert second["chunks_written"] == 0
        assert second["chunks_deduplicated"] == n
        assert second["bytes_written"] < 64 << 10  # the manifest only
    with hs.Store(url) as other:
        third = other.save("c", state).wait()
        assert third["chunks_written"] == 0
        assert len(keys(prefix, "chunks")) == n
        u = other.usage()
        assert u["checkpoints"] == 3 and u["chunks"] == n and u["unreferenced_chunks"] == 0
        assert u["logical_bytes"] > 2.9 * u["unique_bytes"]


def test_remove_and_gc_keep_referenced_chunks(prefix):
    g = torch.Generator().manual_seed(3)
    x, y, z = (torch.randn(1 << 18, generator=g) for _ in range(3))  # 1 MiB: one chunk each
    with hs.Store(url_of(prefix)) as store:
        store.save("a", {"x": x, "y": y}).wait()
        store.save("b", {"y": y, "z": z}).wait()
        assert len(keys(prefix, "chunks")) == 3
        store.remove("a")
        with pytest.raises(hs.NotFoundError):
            store.remove("a")
        assert store.list() == ["b"]
        report = store.gc()
        assert report["chunks_removed"] == 1 and report["bytes_removed"] == (1 << 20) + 16
        assert len(keys(prefix, "chunks")) == 2
        got = store.load("b")
        assert same(got["y"], y) and same(got["z"], z)
        assert store.verify() == []
        assert store.gc()["chunks_removed"] == 0
    assert keys(prefix, "locks") == []


WRITER = r"""
import sys, numpy as np, hindsight as hs

def live(trial, i):
    return np.random.default_rng(trial * 1000 + i).standard_normal(3 << 19, dtype=np.float32)

store = hs.Store(sys.argv[1], chunk_size=1 << 20)
trial = int(sys.argv[2])
print("ready", flush=True)
i = 0
while True:
    name = f"t{trial}-c{i}"
    store.save(name, {"live": live(trial, i), "i": i}).wait()
    print("done", name, flush=True)
    i += 1
"""


def live(trial: int, i: int) -> np.ndarray:
    return np.random.default_rng(trial * 1000 + i).standard_normal(3 << 19, dtype=np.float32)


def test_sigkill_mid_upload_never_lists_a_partial_checkpoint(prefix):
    url = url_of(prefix)
    hs.Store(url, chunk_size=1 << 20).close()
    rng = random.Random(11)
    deadline = time.monotonic() + 20
    trials = 0
    completed: list[str] = []
    while trials < 3 or (time.monotonic() < deadline and trials < 8):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, url, str(trials)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.2, 1.2))
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        completed += [line.split()[1] for line in out.splitlines() if line.startswith("done")]
        trials += 1
    with hs.Store(url, create=False) as store:
        listed = set(store.list())
        # Everything reported durable is listed; everything listed loads bit-exactly.
        assert set(completed) <= listed
        for name in listed:
            t, c = name[1:].split("-c")
            got = store.load(name)
            assert got["i"] == int(c) and np.array_equal(got["live"], live(int(t), int(c))), name
        assert store.verify() == []
        # Kills landed mid-upload: chunks in the bucket that no checkpoint refers to.
        assert store.usage()["unreferenced_chunks"] > 0
    assert len(completed) > 0


def test_corrupt_chunk_object_raises_naming_the_checkpoint(prefix):
    url = url_of(prefix)
    want = {"w": torch.randn(1 << 16, generator=torch.Generator().manual_seed(4))}
    with hs.Store(url) as store:
        store.save("good-one", want).wait()
    [key] = keys(prefix, "chunks")
    client = s3()
    data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[100] ^= 0xFF  # in the payload, after the 16-byte header
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    with hs.Store(url, create=False) as store:
        with pytest.raises(hs.CorruptError, match="good-one") as e:
            store.load("good-one")
        assert key.split("/", 1)[1] in str(e.value)
        problems = store.verify()
        assert len(problems) == 1 and "good-one" in problems[0]
    # A missing chunk object is corruption too.
    client.delete_object(Bucket=BUCKET, Key=key)
    with hs.Store(url, create=False) as store, pytest.raises(hs.CorruptError, match="good-one"):
        store.load("good-one")


@pytest.mark.skipif(shutil.which("cargo") is None, reason="cargo is not on PATH")
@pytest.mark.timeout(900)  # compiles the test binary first if it is stale
def test_rust_storage_conformance_suite_against_s3(s3_server):
    env = {**os.environ, "HINDSIGHT_TEST_S3_URL": f"s3://{BUCKET}/conformance-{uuid.uuid4().hex[:8]}"}
    r = subprocess.run(
        ["cargo", "test", "-p", "hindsight-core", "--features", "s3", "--test", "conformance"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=880,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert "test s3::s3_storage_conforms ... ok" in r.stdout, r.stdout[-3000:]

"""Stores on S3-compatible object storage, against a real S3 protocol server
(moto, a separate process on loopback): round trip, dedup, gc, crash safety,
corruption, and the Rust storage conformance suite."""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

if importlib.util.find_spec("moto") is None or importlib.util.find_spec("boto3") is None:
    pytest.skip("moto[server] is not installed (see requirements-dev.txt)", allow_module_level=True)

import numpy as np
import torch

import hindsight as hs

from s3util import BUCKET, keys, s3, url_of

REPO = Path(__file__).resolve().parent.parent


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


def test_sigkill_mid_upload_never_lists_a_partial_checkpoint(object_url):
    """On every object store backend (S3, Azure, XRootD): writers killed at
    random instants leave only whole checkpoints listed."""
    url = object_url
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
            if not completed:
                # At least one save completes first, however slow the backend.
                first = proc.stdout.readline()
                assert first.startswith("done"), first
                completed.append(first.split()[1])
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


LOCAL_FIRST_WRITER = """
import sys, torch, hindsight as hs
url, local = sys.argv[1], sys.argv[2]
store = hs.Store(url, local_first=local, chunk_size=1 << 20)
g = torch.Generator().manual_seed(5)
store.save("big", {"w": torch.randn(24 << 20, generator=g)}).wait()  # 96 MiB, durable locally
print("local", store.uploads_pending(), flush=True)
import time; time.sleep(60)
"""


def test_local_first_commits_locally_then_uploads_and_flush_waits(prefix, tmp_path):
    url, local = url_of(prefix), tmp_path / "local"
    want = state_dict(21)
    with hs.Store(url, local_first=local) as store:
        assert (store.path, store.local_first) == (url, str(local))
        h = store.save("ckpt-1", want)
        h.wait()  # durable in the local copy
        assert "ckpt-1" in store.list()
        assert store.flush() is True
        assert store.uploads_pending() == 0
        # Uploaded: the destination alone has it, complete and bit-exact.
        with hs.Store(url, create=False) as remote:
            assert remote.list() == ["ckpt-1"]
            assert_same_state(remote.load("ckpt-1"), want)
            assert remote.verify() == []
        # An unchanged second save uploads no chunk again.
        before = set(keys(prefix, "chunks"))
        store.save("ckpt-2", want)
        store.flush()
        assert set(keys(prefix, "chunks")) == before
        # Remove reaches both copies; gc both.
        store.remove("ckpt-1")
        assert store.list() == ["ckpt-2"]
        assert [k.rsplit("/", 1)[1] for k in keys(prefix, "manifests")] == ["ckpt-2.hsm"]
        with pytest.raises(hs.NotFoundError, match="ckpt-1"):
            store.remove("ckpt-1")
    # On a fresh node (no local copy) the checkpoint is read from the destination.
    with hs.Store(url, local_first=tmp_path / "other-node") as store:
        assert store.list() == ["ckpt-2"]
        assert_same_state(store.load("ckpt-2"), want)


def test_local_first_killed_mid_upload_uploads_on_next_open(prefix, tmp_path):
    url, local = url_of(prefix), tmp_path / "local"
    proc = subprocess.Popen(
        [sys.executable, "-c", LOCAL_FIRST_WRITER, url, str(local)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[0] == "local", line
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
    with hs.Store(url, create=False) as remote:
        # Killed while uploading (or just after): never listed half-uploaded.
        listed = remote.list()
        assert listed in ([], ["big"])
        assert remote.verify() == []
    if listed == []:
        assert int(line[1]) == 1  # the upload was still pending when the process died
    # The next process on this node finds the un-uploaded checkpoint and finishes the job.
    with hs.Store(url, local_first=local) as store:
        assert store.flush() is True
    with hs.Store(url, create=False) as remote:
        assert remote.list() == ["big"]
        assert remote.verify() == []
        w = remote.load("big")["w"]
        assert torch.equal(w, torch.randn(24 << 20, generator=torch.Generator().manual_seed(5)))


def test_local_first_upload_failure_surfaces_at_flush_and_keeps_the_local_copy(s3_server, tmp_path):
    bucket = f"hindsight-fail-{uuid.uuid4().hex[:8]}"
    s3().create_bucket(Bucket=bucket)
    url, local = f"s3://{bucket}/ckpts", tmp_path / "local"
    with hs.Store(url, local_first=local) as store:
        store.save("a", {"x": torch.ones(10)})
        store.flush()
        # The destination goes away: every upload now fails.
        for page in s3().get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for o in page.get("Contents", []):
                s3().delete_object(Bucket=bucket, Key=o["Key"])
        s3().delete_bucket(Bucket=bucket)
        store.save("b", {"x": torch.zeros(10)}).wait()  # locally durable: the save itself succeeds
        with pytest.raises(hs.HindsightError, match=rf"b: upload to s3://{bucket}/ckpts"):
            store.flush()
        # Reported once; the checkpoint is safe in the local copy (a later process uploads it).
        assert store.flush() is True
    with hs.Store(local, create=False) as copy:
        assert copy.list() == ["a", "b"]
        assert torch.equal(copy.load("b")["x"], torch.zeros(10))


# Beside another test's load a rank aborted once (C++ terminate, exit -6;
# not seen alone): alone until that is understood (docs/testing.md).
@pytest.mark.serial
def test_two_torchrun_ranks_commit_one_checkpoint_on_s3_that_loads_on_one_rank(prefix, tmp_path):
    """hindsight.dist on object storage (what ranks on several nodes share):
    each rank's part is uploaded, rank 0 finds them by listing, commits the
    merged manifest last, and removes the parts."""
    from test_dist import assert_equal, torchrun, weights

    url = url_of(prefix)
    r = torchrun(2, "fsdp-train", url, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert hs.Store(url).list() == ["ck-3"]
    assert keys(prefix, "manifests") == [f"{prefix}/manifests/ck-3.hsm"]
    r = torchrun(1, "fsdp-load", url, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_equal(weights(tmp_path / "loaded-fsdp-load-1.pt"), weights(tmp_path / "at-3.pt"))

"""root:// stores on a real XRootD server (tests/xrootdutil.py): what only
this backend can get wrong. The conformance suite (crates/hindsight-core/
tests/conformance.rs) and the tests taking `object_url` cover the rest."""

from __future__ import annotations

import subprocess
import uuid

import pytest
import torch

import hindsight as hs


@pytest.fixture
def url(xrootd_server_url: str) -> str:
    return f"{xrootd_server_url}//tests/{uuid.uuid4().hex[:12]}"


def chunk_paths(url: str) -> list[str]:
    server, path = url.split("//", 2)[1:]
    out = subprocess.run(
        ["xrdfs", f"root://{server}", "ls", "-R", f"/{path}/chunks"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    return [p for p in out if len(p.rsplit("/", 1)[-1]) > 40]


def test_a_damaged_or_missing_chunk_is_named_never_loaded(url):
    want = {"w": torch.randn(1 << 16, generator=torch.Generator().manual_seed(4))}
    with hs.Store(url) as store:
        store.save("good-one", want).wait()
        assert torch.equal(store.load("good-one")["w"], want["w"])
    [chunk] = chunk_paths(url)
    server = url.split("//")[1]
    data = bytearray(
        subprocess.run(["xrdcp", "-s", f"root://{server}/{chunk}", "-"], capture_output=True, check=True).stdout
    )
    data[100] ^= 0xFF  # in the payload, after the 16-byte header
    subprocess.run(["xrdcp", "-s", "-f", "-", f"root://{server}/{chunk}"], input=bytes(data), check=True)
    with hs.Store(url, create=False) as store:
        with pytest.raises(hs.CorruptError, match="good-one") as e:
            store.load("good-one")
        assert chunk.rsplit("/", 1)[-1] in str(e.value)
        assert len(store.verify()) == 1
    # The damaged chunk was moved out of use; the checkpoint now lacks it,
    # which is corruption too.
    assert chunk_paths(url) == []
    with hs.Store(url, create=False) as store, pytest.raises(hs.CorruptError, match="good-one"):
        store.load("good-one")


def test_a_client_without_credentials_is_refused_naming_the_store(url, monkeypatch):
    """The server authenticates every call: without the key, opening the
    store fails with an error that names it, and nothing is written."""
    monkeypatch.delenv("XrdSecSSSKT")
    with pytest.raises(hs.HindsightError) as e:
        hs.Store(url)
    assert url.split("//")[1] in str(e.value), e.value
    assert "auth" in str(e.value).lower(), e.value


def test_a_url_with_one_slash_names_the_same_absolute_path(xrootd_server_url):
    """root://host/path and root://host//path are one store (XRootD paths
    are absolute), and the store says its location the canonical way."""
    name = f"tests/{uuid.uuid4().hex[:12]}"
    with hs.Store(f"{xrootd_server_url}/{name}") as store:
        store.save("a", {"x": torch.arange(3)}).wait()
        assert store.path == f"{xrootd_server_url}//{name}"
    with hs.Store(f"{xrootd_server_url}//{name}", create=False) as store:
        assert store.list() == ["a"]


def test_a_new_store_takes_large_chunks_unless_asked(url):
    """Each XRootD object costs a few client calls, so a new root:// store
    gets 32 MiB chunks (docs/xrootd.md); an explicit chunk_size still wins."""
    with hs.Store(url) as store:
        assert store._native.chunk_size == 32 << 20
    with hs.Store(url + "-small", chunk_size=1 << 20) as store:
        assert store._native.chunk_size == 1 << 20
    with hs.Store(url, create=False) as store:  # the store keeps what it was created with
        assert store._native.chunk_size == 32 << 20

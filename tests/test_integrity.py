"""Every byte is verified on load; nothing executes code on load."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

import hindsight as hs

from conftest import hindsight_cmd


def chunk_files(store_dir: Path) -> list[Path]:
    return sorted(p for p in (store_dir / "chunks").rglob("*") if p.is_file())


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_flipped_byte_in_a_chunk_is_detected_and_named(store_dir):
    store = hs.Store(store_dir)
    store.save("ep1", {"model": {"layer.weight": torch.randn(1000)}}).wait()
    [chunk] = chunk_files(store_dir)
    flip_byte(chunk, 100)
    with pytest.raises(hs.CorruptError) as e:
        store.load("ep1")
    msg = str(e.value)
    assert "ep1" in msg and "model/layer.weight" in msg and chunk.name in msg
    # What the error is about is also there to act on, as attributes.
    assert (e.value.checkpoint, e.value.key_path, e.value.path) == ("ep1", "model/layer.weight", str(chunk))
    problems = store.verify()
    assert len(problems) == 1 and chunk.name in problems[0]
    # The CLI reports the same and exits non-zero.
    r = subprocess.run([*hindsight_cmd(), "verify", str(store_dir)], capture_output=True, text=True)
    assert r.returncode == 1 and "FAIL ep1" in r.stdout and "model/layer.weight" in r.stdout


def test_flipped_byte_anywhere_in_a_manifest_is_detected(store_dir):
    store = hs.Store(store_dir)
    store.save("m", {"x": torch.arange(10), "s": "text"}).wait()
    manifest = store_dir / "manifests" / "m.hsm"
    size = manifest.stat().st_size
    original = manifest.read_bytes()
    for offset in range(0, size, max(1, size // 40)):
        flip_byte(manifest, offset)
        with pytest.raises(hs.CorruptError, match=r"m\.hsm"):
            store.load("m")
        manifest.write_bytes(original)
    assert torch.equal(store.load("m")["x"], torch.arange(10))


def test_truncated_and_missing_chunks_are_corruption_not_wrong_data(store_dir):
    store = hs.Store(store_dir, chunk_size=4096)
    store.save("t", {"a": torch.randn(4096)}).wait()  # 4 chunks
    files = chunk_files(store_dir)
    files[0].write_bytes(files[0].read_bytes()[:-10])
    os.remove(files[1])
    with pytest.raises(hs.CorruptError):
        store.load("t")
    problems = store.verify()
    assert len(problems) == 2
    assert any("truncated" in p for p in problems) and any("missing" in p for p in problems)


def test_unsupported_object_is_refused_with_its_key_path(store_dir):
    class Custom:
        pass

    store = hs.Store(store_dir)
    with pytest.raises(hs.UnsupportedTypeError, match=r"Custom at key 'optim/extra/1'"):
        store.save("x", {"optim": {"extra": [1, Custom()]}})
    with pytest.raises(TypeError):  # also a TypeError for generic handlers
        store.save("x", {"f": lambda: 0})
    assert store.list() == []
    # Sparse tensors are refused too rather than silently densified.
    with pytest.raises(hs.UnsupportedTypeError, match="sparse"):
        store.save("x", {"s": torch.eye(3).to_sparse()})


def test_a_tree_deeper_than_load_reads_is_refused_at_save_and_the_store_stays_usable(store_dir):
    """One save of a 41-level dict used to commit, then fail at load, and
    make gc and usage fail for the whole store."""
    deep: dict = {"leaf": torch.ones(2)}
    for i in range(41):
        deep = {f"k{i}": deep}
    store = hs.Store(store_dir)
    store.save("ok", {"w": torch.zeros(3)}).wait()
    with pytest.raises(hs.InvalidArgumentError, match=r"checkpoint 'deep': nesting deeper than 32 levels at 'k40/k39/"):
        store.save("deep", deep).wait()
    assert store.list() == ["ok"]
    store.gc()
    assert store.usage()["checkpoints"] == 1
    assert torch.equal(store.load("ok")["w"], torch.zeros(3))


class Exploit:
    """Unpickling this would create a file: proof of code execution."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_only_by_explicit_opt_in_on_both_sides(store_dir, tmp_path):
    marker = tmp_path / "pwned"
    store = hs.Store(store_dir)
    with pytest.raises(hs.UnsupportedTypeError):
        store.save("p", {"obj": Exploit(str(marker))})
    store.save("p", {"obj": Exploit(str(marker)), "w": torch.ones(2)}, allow_pickle=True).wait()
    assert not marker.exists()
    with pytest.raises(hs.UnsupportedTypeError, match="pickled object at key 'obj'"):
        store.load("p")
    assert not marker.exists(), "loading without allow_pickle must never run code"
    # A partial load that avoids the pickled key works without opting in.
    assert torch.equal(store.load("p", path="w"), torch.ones(2))
    store.load("p", allow_pickle=True)["obj"].close()
    assert marker.exists()


def test_pickle_round_trip_of_plain_objects(store_dir):
    from fractions import Fraction

    store = hs.Store(store_dir)
    store.save("f", {"frac": Fraction(1, 3), "set": {1, 2}}, allow_pickle=True).wait()
    got = store.load("f", allow_pickle=True)
    assert got == {"frac": Fraction(1, 3), "set": {1, 2}}


def test_errors_carry_their_subject_as_attributes(store_dir):
    store = hs.Store(store_dir)
    with pytest.raises(hs.InvalidArgumentError) as bad:
        store.save("../escape", {"x": 1})
    assert bad.value.arg is not None and "../escape" in bad.value.arg and isinstance(bad.value, ValueError)
    with pytest.raises(hs.UnsupportedTypeError) as unsupported:
        store.save("u", {"model": {"obj": object()}})
    assert unsupported.value.key_path == "model/obj"
    with pytest.raises(hs.NotFoundError) as missing:
        store.load("nope")
    assert missing.value.checkpoint is None and isinstance(missing.value, LookupError)
    store.close()
    with pytest.raises(hs.StoreClosedError) as closed:
        store.save("late", {"x": 1})
    assert isinstance(closed.value, hs.CancelledError) and str(store_dir) in str(closed.value)
    with pytest.raises(hs.InvalidArgumentError) as compression:
        hs.Store(store_dir.parent / "other", compression="lz4")
    assert compression.value.arg == "compression"


def test_dataframe_refuses_a_damaged_log_database_as_the_cli_does(tmp_path: Path) -> None:
    """Issue 22: `hs.dataframe` skipped the check `hindsight logs` runs and
    answered from a damaged database. One read path, one check (core's
    `LogDb::open_checked`)."""
    import sqlite3
    import sys

    script = tmp_path / "t.py"
    script.write_text(
        "import hindsight as hs\nfor e in hs.loop('epoch', range(3)):\n    hs.log('loss', 1.0 / (e + 1))\n"
    )
    env = {**os.environ, "HINDSIGHT_HOME": str(tmp_path / ".hindsight")}
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    read = [sys.executable, "-c", "import hindsight as hs; print(len(hs.dataframe('loss')))"]
    ok = subprocess.run(read, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.strip() == "3", ok.stderr
    # A row no run owns (damage, or a writer that bypassed the foreign keys).
    con = sqlite3.connect(tmp_path / ".hindsight" / "logs.db")
    con.execute("PRAGMA foreign_keys = OFF")
    con.execute(
        "INSERT INTO logs (run_id, name, ctx, value, phase, seq, created_ms) "
        "VALUES ('no-such-run', 'loss', '{}', '9', 'record', 99, 0)"
    )
    con.commit()
    con.close()
    bad = subprocess.run(read, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0
    assert "CorruptError" in bad.stderr and "logs.db" in bad.stderr, bad.stderr
    cli = subprocess.run([*hindsight_cmd(), "logs", "loss"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert cli.returncode != 0 and "belong to no run" in cli.stderr, cli.stderr

    # A changed digit inside a value: valid SQLite, so only the row's
    # checksum sees it; both read paths refuse, naming the row.
    con = sqlite3.connect(tmp_path / ".hindsight" / "logs.db")
    con.execute("PRAGMA foreign_keys = OFF")
    con.execute("DELETE FROM logs WHERE run_id = 'no-such-run'")
    con.execute("""UPDATE logs SET value = '0.3' WHERE ctx = '{"epoch":2}'""")
    con.commit()
    con.close()
    bad = subprocess.run(read, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0
    assert "CorruptError" in bad.stderr and "'loss' at {\"epoch\":2}" in bad.stderr, bad.stderr
    assert "checksum" in bad.stderr, bad.stderr
    cli = subprocess.run([*hindsight_cmd(), "logs", "loss"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert cli.returncode != 0 and "fails its checksum" in cli.stderr, cli.stderr

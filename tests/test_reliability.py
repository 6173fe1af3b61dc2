"""The holes an unlucky or hostile user finds (issue 11): each test reproduces
one and pins the fix."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hindsight as hs

from conftest import hindsight_cmd


def test_a_save_after_gc_took_its_reused_chunks_copies_them_again(store_dir: Path) -> None:
    store = hs.Store(store_dir)
    f = torch.randn(1 << 20)
    store.save("a", {"f": f}).wait()
    store.remove("a")
    store.gc()  # the only chunk of `f`, which the writer would reuse, is gone
    store.save("b", {"f": f}).wait()
    assert torch.equal(store.load("b")["f"], f)
    # ...and the writer is not left broken: later saves keep working.
    store.save("c", {"f": f}).wait()
    assert torch.equal(store.load("c")["f"], f)
    assert store.verify() == []


def test_saving_while_another_process_runs_gc_never_fails(store_dir: Path) -> None:
    # One process replaces a checkpoint over and over (remove, then save
    # again, reusing the unchanged tensor) while another runs gc in a loop:
    # every save must succeed and load exactly.
    hs.Store(store_dir)  # create it
    gc_loop = textwrap.dedent(
        f"""
        import os, sys, time, hindsight as hs
        s = hs.Store({str(store_dir)!r})
        print("ready", flush=True)
        end = time.monotonic() + 60
        while time.monotonic() < end and not os.path.exists({str(store_dir.parent / "stop")!r}):
            s.gc()
        """
    )
    gc = subprocess.Popen([sys.executable, "-c", gc_loop], stdout=subprocess.PIPE, text=True)
    assert gc.stdout is not None
    try:
        assert gc.stdout.readline().strip() == "ready"
        store = hs.Store(store_dir)
        frozen = torch.randn(1 << 18)  # unchanged across saves: reused
        w = torch.zeros(1 << 16)
        for _ in range(40):
            w += 1
            if "latest" in store.list():
                store.remove("latest")
            store.save("latest", {"frozen": frozen, "w": w}).wait()
            loaded = store.load("latest")
            assert torch.equal(loaded["frozen"], frozen) and torch.equal(loaded["w"], w)
        assert store.verify() == []
    finally:
        (store_dir.parent / "stop").touch()
        gc.stdout.close()
        assert gc.wait(timeout=60) == 0


def test_remove_of_a_checkpoint_still_being_saved_removes_it(store_dir: Path) -> None:
    store = hs.Store(store_dir)
    big = torch.randn(16 << 20)  # 64 MiB: the write is still running when remove comes
    h = store.save("ck", {"big": big})
    store.remove("ck")  # waits for the save, then removes it
    assert h.done()
    store.flush()
    assert "ck" not in store.list()


def test_gc_never_deletes_through_a_symlinked_store_directory(tmp_path: Path, store_dir: Path) -> None:
    hs.Store(store_dir).save("a", {"x": torch.ones(3)}).wait()
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "chapter1.tex").write_text("years of work")
    (store_dir / "tmp").rmdir()
    (store_dir / "tmp").symlink_to(thesis)
    with pytest.raises(hs.HindsightError, match="symbolic link"):
        hs.Store(store_dir).gc()
    r = subprocess.run([*hindsight_cmd(), "gc", str(store_dir)], capture_output=True, text=True)
    assert r.returncode != 0 and "symbolic link" in r.stderr
    assert (thesis / "chapter1.tex").read_text() == "years of work"


def test_a_symlinked_chunk_directory_is_never_written_read_or_emptied_through(tmp_path: Path, store_dir: Path) -> None:
    """Issue 22: with `chunks/ab` a link to a directory outside the store,
    saves wrote chunk files there and a damaged chunk read through it was
    moved from there into the store's quarantine."""
    store = hs.Store(store_dir)
    store.save("a", {"x": torch.arange(1000, dtype=torch.float32)}).wait()
    store.close()
    outside = tmp_path / "outside"
    outside.mkdir()
    chunks = store_dir / "chunks"
    for fan in chunks.iterdir():  # the existing chunks move out, behind links
        for f in fan.iterdir():
            (outside / f.name).write_bytes(b"damaged")  # what a read would "quarantine"
        shutil.rmtree(fan)
    for i in range(256):
        (chunks / f"{i:02x}").symlink_to(outside)
    before = sorted(p.name for p in outside.iterdir())
    store = hs.Store(store_dir)
    with pytest.raises(hs.HindsightError, match="symbolic link"):
        store.load("a")
    with pytest.raises(hs.HindsightError, match="symbolic link"):
        store.save("b", {"y": torch.randn(100)}).wait()
    store.close()
    assert sorted(p.name for p in outside.iterdir()) == before, "nothing written or moved outside the store"
    assert all(p.read_bytes() == b"damaged" for p in outside.iterdir())
    assert not (store_dir / "quarantine").exists() or not any((store_dir / "quarantine").iterdir())


@pytest.mark.parametrize("location", ["", "S3://bucket/p", "s3:/bucket/p"])
def test_store_locations_that_are_not_what_they_seem_are_refused(
    location: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(hs.InvalidArgumentError):
        hs.Store(location)
    assert not any(tmp_path.iterdir())


def test_loads_racing_a_replacing_writer_and_gc_never_report_corruption(store_dir: Path) -> None:
    # Another process saves "ck" again and again (new content each time) and
    # runs gc after each, deleting the chunks of the version being loaded.
    # A load returns one consistent version; it is never called corrupt.
    store = hs.Store(store_dir)
    store.save("ck", {"x": torch.full((1 << 18,), 0.0)}).wait()
    writer = textwrap.dedent(
        f"""
        import os, time, torch, hindsight as hs
        s = hs.Store({str(store_dir)!r})
        i, end = 1, time.monotonic() + 60
        while time.monotonic() < end and not os.path.exists({str(store_dir.parent / "stop")!r}):
            s.save("ck", {{"x": torch.full((1 << 18,), float(i))}}).wait()
            s.gc()
            i += 1
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", writer])
    try:
        loads = 0
        for _ in range(150):
            try:
                x = store.load("ck")["x"]
            except hs.NotFoundError:
                continue  # between a remove and a save: reported as such, not as damage
            assert bool((x == x[0]).all()), "a load mixed two versions"
            loads += 1
        assert loads > 0
    finally:
        (store_dir.parent / "stop").touch()
        assert proc.wait(timeout=60) == 0


def test_a_damaged_chunk_is_rewritten_by_the_next_save_with_its_bytes(store_dir: Path) -> None:
    frozen = torch.randn(1 << 16)  # a frozen layer, saved unchanged every epoch
    store = hs.Store(store_dir)
    store.save("ep1", {"frozen": frozen}).wait()
    [chunk] = sorted(p for p in (store_dir / "chunks").rglob("*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x40  # bit rot
    chunk.write_bytes(bytes(data))
    with pytest.raises(hs.CorruptError, match="quarantined"):
        store.load("ep1")
    # The next save with the same bytes must write them again, not trust
    # the damaged copy; that also repairs ep1, which shares the chunk.
    store2 = hs.Store(store_dir)
    store2.save("ep2", {"frozen": frozen}).wait()
    assert torch.equal(store2.load("ep2")["frozen"], frozen)
    assert torch.equal(store2.load("ep1")["frozen"], frozen)
    assert store2.verify() == []
    assert any((store_dir / "quarantine").iterdir())  # the damaged bytes are kept aside


@pytest.mark.parametrize("options", [{"chunk_size": -1}, {"chunk_size": 1}, {"zstd_level": 99, "compression": "zstd"}])
def test_bad_store_options_are_refused_by_name_and_leave_nothing(tmp_path: Path, options: dict[str, object]) -> None:
    where = tmp_path / "new-store"
    with pytest.raises(hs.InvalidArgumentError) as e:
        hs.Store(where, **options)  # type: ignore[arg-type]
    assert e.value.arg in options
    assert not where.exists()


def test_a_read_only_home_is_read_by_the_commands_and_the_dataframe(tmp_path: Path) -> None:
    """A project on a read-only mount (an archive, another user's results):
    `runs`, `logs`, `verify` and `hs.dataframe` answer from it and write
    nothing (issue 42, item 9)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("no mount here: a read-only file system cannot be made")
    try:
        script = mnt / "train.py"
        script.write_text(
            textwrap.dedent(
                """
                import torch, hindsight as hs
                net = torch.nn.Linear(2, 1)
                with hs.checkpointing(model=net):
                    for epoch in hs.loop("epoch", range(3)):
                        hs.log("loss", float(epoch))
                """
            )
        )
        env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("HINDSIGHT_")}
        rec = subprocess.run(
            [sys.executable, "train.py"], cwd=mnt, env=env, capture_output=True, text=True, timeout=120
        )
        assert rec.returncode == 0, rec.stderr[-2000:]
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        before = sorted(p.name for p in (mnt / ".hindsight").iterdir())
        for args, want in ((["runs"], "completed"), (["logs", "loss"], "2"), (["verify"], "")):
            r = subprocess.run([*hindsight_cmd(), *args], cwd=mnt, env=env, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, (args, r.stderr[-2000:])
            assert want in r.stdout, (args, r.stdout)
        code = "import hindsight as hs; df = hs.dataframe('loss'); print(sorted(df['loss'].tolist()))"
        r = subprocess.run([sys.executable, "-c", code], cwd=mnt, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "[0.0, 1.0, 2.0]" in r.stdout, r.stderr[-2000:]
        assert sorted(p.name for p in (mnt / ".hindsight").iterdir()) == before
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)

"""Fault injection against the checkpoint store, bounded in time, with a table
of trials, failures and failure kinds (`make chaos`; `--quick` is what CI runs
through tests/test_chaos.py).

1. kill -9: a process saves, replaces, removes and gc's checkpoints; it is
   killed at a random instant. Afterwards every listed checkpoint must load
   and verify (no torn checkpoint is ever visible).
2. gc vs writers: two processes keep replacing checkpoints (reusing unchanged
   tensors) while a third runs gc in a loop. No save may fail, no load may be
   called corrupt.
3. corruption sweep: one file of a store (chunk or manifest) is flipped,
   truncated or deleted. Loading every checkpoint must either return the
   saved values or raise CorruptError / NotFoundError: never wrong values.
4. manifest fuzzer: the proptest in crates/hindsight-core/tests/manifests.rs
   with many cases (mutated, re-signed manifests must be Corrupt, never a panic).
5. store-wide hazards: a manifest gc cannot read (random bytes, another
   format version, a tree deeper than the reader takes) planted beside good
   checkpoints; a chunk fan-out directory or tmp/ replaced by a symlink to a
   directory outside the store. Saves, loads, verify, usage and gc must
   answer (or refuse with a named error), never lose a good checkpoint, never
   let gc remove a chunk an unreadable manifest may name, and never create,
   move or delete anything outside the store.
6. another user's store: a store owned by another user (uid 65534), whole
   or with its chunks, one manifest or one chunk unreadable, opened by a
   process that may not override file permissions (root without
   CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH/CAP_FOWNER, via `setpriv`). Every
   operation (open, list, load, save, remove, gc, usage, verify) must answer
   or refuse with a named hindsight error, and leave the store unchanged;
   a readable store's checkpoint must still load exactly. Skipped, and
   said, where this process is not root or has no `setpriv`.
7. input-service workers: each trial reads one epoch from `hs.data.Loader`
   (3 worker processes) while a random worker is SIGKILLed or SIGSTOPped
   (and SIGCONTed 1.5 s later) at a random batch. The epoch must hold every
   example once, with the batches and random draws of a run without
   failures; duplicates and missing examples are counted.
8. one name, two savers: two processes save `latest` in one store at
   random moments, each save's arrays all one value. Every load must be one
   save whole (never a mix), and a save may only fail naming the conflict.
9. crafted `files` entries: random hostile entry names (links, dots, NUL,
   long names, escapes, the script, the home) beside a good one. Each put
   back must write all or nothing, only under the directory, or refuse
   with a named hindsight error; nothing outside changes.
10. two resumes of one interrupted run at once: exactly one resumes and
   completes, the other is refused in one line (exit 2).
11. a rogue worker and a flood: worker processes with a wrong token, and
   without one, try to join a real dispatcher while a trainer reads an
   epoch: each is refused by name, the epoch is exact, and the dispatcher's
   memory grows by less than 64 MiB.

Everything runs on local files in a temporary directory and stops by itself.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import hindsight as hs

REPO = Path(__file__).resolve().parent.parent

SAVER = textwrap.dedent(
    """
    import sys, torch, hindsight as hs
    s = hs.Store(sys.argv[1])
    frozen = torch.arange(1 << 16, dtype=torch.float32)
    w = torch.zeros(1 << 15)
    i = 0
    while True:
        i += 1
        w += 1
        s.save(f"ck{i % 4}", {"frozen": frozen, "w": w, "i": i}).wait()
        if i % 3 == 0:
            s.remove(f"ck{(i + 1) % 4}") if f"ck{(i + 1) % 4}" in s.list() else None
        if i % 5 == 0:
            s.gc()
    """
)


def check_store(path: Path) -> str | None:
    """None if every listed checkpoint loads exactly as some save wrote it."""
    s = hs.Store(path)
    frozen = torch.arange(1 << 16, dtype=torch.float32)
    for name in s.list():
        try:
            state = s.load(name)
        except hs.HindsightError as e:
            return f"{type(e).__name__}"
        if not torch.equal(state["frozen"], frozen) or not bool((state["w"] == float(state["i"])).all()):
            return "wrong values"
    problems = s.verify()
    return "verify: " + problems[0][:60] if problems else None


def kill9(trials: int, base: Path, rng: random.Random) -> tuple[int, collections.Counter[str]]:
    kinds: collections.Counter[str] = collections.Counter()
    store = base / "kill9"
    for _ in range(trials):
        p = subprocess.Popen([sys.executable, "-c", SAVER, str(store)], stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 1.5))
        p.send_signal(signal.SIGKILL)
        p.wait()
        problem = check_store(store)
        if problem:
            kinds[problem] += 1
    return trials, kinds


REPLACER = textwrap.dedent(
    """
    import sys, time, torch, hindsight as hs
    s = hs.Store(sys.argv[1]); tag = sys.argv[2]; end = time.monotonic() + float(sys.argv[3])
    frozen = torch.arange(1 << 16, dtype=torch.float32)
    w = torch.zeros(1 << 15)
    ok = bad = 0
    while time.monotonic() < end:
        w += 1
        try:
            s.save(tag, {"frozen": frozen, "w": w}).wait()
            x = s.load(tag)
            assert torch.equal(x["frozen"], frozen) and torch.equal(x["w"], w)
            ok += 1
        except hs.HindsightError as e:
            bad += 1
            print("FAIL", type(e).__name__, flush=True)
    print("OK", ok, bad, flush=True)
    """
)

GC_LOOP = textwrap.dedent(
    """
    import sys, time, hindsight as hs
    s = hs.Store(sys.argv[1]); end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        s.gc()
    """
)


def gc_vs_writers(seconds: float, base: Path) -> tuple[int, collections.Counter[str]]:
    store = base / "gcw"
    hs.Store(store)
    gc = subprocess.Popen([sys.executable, "-c", GC_LOOP, str(store), str(seconds)])
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", REPLACER, str(store), tag, str(seconds)], stdout=subprocess.PIPE, text=True
        )
        for tag in ("a", "b")
    ]
    kinds: collections.Counter[str] = collections.Counter()
    trials = 0
    for w in writers:
        out, _ = w.communicate(timeout=seconds + 120)
        for line in out.splitlines():
            if line.startswith("FAIL"):
                kinds[line.split()[1]] += 1
            elif line.startswith("OK"):
                trials += int(line.split()[1]) + int(line.split()[2])
        if w.returncode != 0:
            kinds[f"writer exit {w.returncode}"] += 1
    gc.wait(timeout=seconds + 120)
    if gc.returncode != 0:
        kinds[f"gc exit {gc.returncode}"] += 1
    return trials, kinds


def corruption(trials: int, base: Path, rng: random.Random) -> tuple[int, collections.Counter[str]]:
    pristine = base / "pristine"
    s = hs.Store(pristine)
    saved = {}
    for i in range(4):
        state = {"w": torch.full((1 << 14,), float(i)), "shared": torch.arange(1 << 14, dtype=torch.float64)}
        s.save(f"ck{i}", state).wait()
        saved[f"ck{i}"] = state
    s.close()
    files = [p for p in pristine.rglob("*") if p.is_file() and p.parent.name != "tmp" and p.name != "gc.lock"]
    kinds: collections.Counter[str] = collections.Counter()
    for t in range(trials):
        copy = base / f"c{t}"
        shutil.copytree(pristine, copy)
        victim = copy / rng.choice(files).relative_to(pristine)
        data = bytearray(victim.read_bytes())
        how = rng.choice(["flip", "truncate", "delete"])
        if how == "flip" and data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            victim.write_bytes(bytes(data))
        elif how == "truncate" and data:
            victim.write_bytes(bytes(data[: rng.randrange(len(data))]))
        else:
            victim.unlink()
        try:
            st = hs.Store(copy)
        except hs.HindsightError:
            shutil.rmtree(copy)
            continue  # refused to open: detected
        for name, want in saved.items():
            try:
                got = st.load(name)
            except (hs.CorruptError, hs.NotFoundError):
                continue
            except Exception as e:  # anything else is a finding
                kinds[f"{type(e).__name__} on {how}"] += 1
                continue
            if not all(torch.equal(got[k], want[k]) for k in want):
                kinds[f"wrong values after {how}"] += 1
        st.close()
        shutil.rmtree(copy)
    return trials, kinds


def fuzz(cases: int) -> tuple[int, collections.Counter[str]]:
    r = subprocess.run(
        ["cargo", "test", "-q", "-p", "hindsight-core", "--test", "manifests"],
        cwd=REPO,
        env={**os.environ, "HINDSIGHT_FUZZ_CASES": str(cases)},
        capture_output=True,
        text=True,
    )
    kinds: collections.Counter[str] = collections.Counter()
    if r.returncode != 0:
        kinds["proptest failure (see cargo test output)"] += 1
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
    return cases, kinds


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def store_hazards(trials: int, base: Path, rng: random.Random) -> tuple[int, collections.Counter[str]]:
    kinds: collections.Counter[str] = collections.Counter()
    good = {"w": torch.arange(1 << 14, dtype=torch.float32), "i": 7}

    def intact(s: hs.Store, how: str) -> None:
        got = s.load("good")
        if not torch.equal(got["w"], good["w"]) or got["i"] != 7:
            kinds[f"good checkpoint changed ({how})"] += 1

    for t in range(trials):
        root = base / f"h{t}"
        store_dir, outside = root / "store", root / "outside"
        outside.mkdir(parents=True)
        (outside / "sentinel").write_bytes(b"keep me")
        s = hs.Store(store_dir, chunk_size=4096)
        s.save("good", good).wait()
        s.save("gone", {"x": torch.randn(4096)}).wait()
        s.remove("gone")  # its chunks: what gc may remove
        how = rng.choice(["random bytes", "format version", "too deep", "symlinked fan-out", "symlinked tmp"])
        try:
            if how in ("random bytes", "format version"):
                m = store_dir / "manifests" / "good.hsm"
                planted = bytearray(m.read_bytes()) if how == "format version" else bytearray(rng.randbytes(200))
                if how == "format version":
                    planted[4:8] = (99).to_bytes(4, "little")
                (store_dir / "manifests" / "planted.hsm").write_bytes(bytes(planted))
                chunks = sorted((store_dir / "chunks").rglob("*"))
                try:
                    s.usage()
                    if s.gc()["chunks_removed"]:
                        kinds[f"gc removed chunks beside an unreadable manifest ({how})"] += 1
                except hs.HindsightError:
                    kinds[f"one manifest stopped usage or gc for the whole store ({how})"] += 1
                if sorted((store_dir / "chunks").rglob("*")) != chunks:
                    kinds[f"chunk files changed ({how})"] += 1
                intact(s, how)
            elif how == "too deep":
                deep: dict[str, object] = {}
                cur = deep
                for _ in range(rng.randrange(33, 200)):
                    cur["k"] = {}
                    cur = cur["k"]  # type: ignore[assignment]
                try:
                    s.save("deep", deep).wait()
                    kinds["a tree deeper than the reader takes was saved"] += 1
                except hs.HindsightError:
                    pass
                s.usage()
                s.gc()
                intact(s, how)
                if "deep" in s.list():
                    kinds["a refused save is listed"] += 1
            else:
                sub = (
                    "tmp"
                    if how == "symlinked tmp"
                    else "chunks/" + rng.choice([p.name for p in (store_dir / "chunks").iterdir()])
                )
                target = store_dir / sub
                moved = root / "moved"
                shutil.move(str(target), moved)
                os.symlink(outside, target)
                before = _tree(outside)
                ops = (
                    ("save", lambda st: st.save("more", {"y": torch.randn(8192)}).wait()),
                    ("load", lambda st: st.load("good")),
                    ("verify", lambda st: st.verify()),
                    ("gc", lambda st: st.gc()),
                    ("usage", lambda st: st.usage()),
                )
                for _, op in ops:
                    with contextlib.suppress(hs.HindsightError):
                        op(s)
                if _tree(outside) != before:
                    kinds[f"wrote, moved or deleted outside the store ({how})"] += 1
        except hs.HindsightError:
            pass  # refused with a named error: what is asked
        except Exception as e:  # anything else is a finding
            kinds[f"{type(e).__name__} ({how})"] += 1
        finally:
            s.close()
            shutil.rmtree(root, ignore_errors=True)
    return trials, kinds


OTHER_USER = textwrap.dedent(
    """
    import json, sys, torch, hindsight as hs
    out = {}
    try:
        s = hs.Store(sys.argv[1])
    except hs.HindsightError as e:
        print(json.dumps({"open": type(e).__name__}))
        raise SystemExit
    ops = {
        "list": lambda: s.list(),
        "load": lambda: float(s.load("good")["w"].sum()),
        "save": lambda: s.save("more", {"y": torch.randn(4096)}).wait(),
        "remove": lambda: s.remove("good"),
        "gc": lambda: s.gc(),
        "usage": lambda: s.usage(),
        "verify": lambda: s.verify(),
    }
    for name, op in ops.items():
        try:
            r = op()
            out[name] = r if name in ("list", "load") else "ok"
        except hs.HindsightError as e:
            out[name] = type(e).__name__
        except Exception as e:
            out[name] = "UNNAMED " + type(e).__name__ + ": " + str(e)[:200]
    print(json.dumps(out))
    """
)
_NO_DAC = "dac_override,-dac_read_search,-fowner,-chown"


def other_users_store(trials: int, base: Path, rng: random.Random) -> tuple[int, collections.Counter[str]]:
    kinds: collections.Counter[str] = collections.Counter()
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        print("  another user's store: skipped (needs root and setpriv)", file=sys.stderr)
        return 0, kinds
    good = torch.arange(1 << 14, dtype=torch.float32)
    for t in range(trials):
        store_dir = base / f"u{t}" / "store"
        s = hs.Store(store_dir, chunk_size=4096)
        s.save("good", {"w": good}).wait()
        s.close()
        how = rng.choice(["readable", "unreadable", "chunks dir", "one manifest", "one chunk"])
        for p in [store_dir, *store_dir.rglob("*")]:
            os.chown(p, 65534, 65534, follow_symlinks=False)
            p.chmod(0o755 if p.is_dir() else 0o644)
        if how == "unreadable":
            store_dir.chmod(0o700)
        elif how == "chunks dir":
            (store_dir / "chunks").chmod(0o700)
        elif how == "one manifest":
            (store_dir / "manifests" / "good.hsm").chmod(0o600)
        elif how == "one chunk":
            rng.choice([p for p in (store_dir / "chunks").rglob("*") if p.is_file()]).chmod(0o600)
        before = _tree(store_dir)
        cmd = [setpriv, f"--inh-caps=-{_NO_DAC}", f"--bounding-set=-{_NO_DAC}", sys.executable, "-c", OTHER_USER]
        r = subprocess.run([*cmd, str(store_dir)], capture_output=True, text=True, timeout=120)
        try:
            got = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            kinds[f"crashed ({how}): {r.stderr.strip().splitlines()[-1:] or r.returncode}"] += 1
            continue
        for name, v in got.items():
            if isinstance(v, str) and v.startswith("UNNAMED"):
                kinds[f"{name}: {v} ({how})"] += 1
        if how == "readable" and got.get("load") != float(good.sum()):
            kinds[f"a readable store's checkpoint did not load ({got.get('load')})"] += 1
        if _tree(store_dir) != before:
            kinds[f"the store changed ({how})"] += 1
        if got.get("save") == "ok" or got.get("remove") == "ok":
            kinds[f"a write succeeded without permission ({how})"] += 1
        shutil.rmtree(store_dir.parent, ignore_errors=True)
    return trials, kinds


def _resume(pid: int) -> None:
    """SIGCONT a stopped worker, unless it is gone by now."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def data_workers(trials: int, rng: random.Random) -> tuple[int, collections.Counter[str]]:
    import threading

    sys.path.insert(0, str(REPO / "tests"))
    import data_synth  # the test datasets: each example records its index and draws

    kinds: collections.Counter[str] = collections.Counter()
    dups = missing = 0
    timers: list[threading.Timer] = []
    with hs.data.Loader(
        data_synth.make, batch_size=8, seed=1, workers="local:3", dataset_args={"n": 160, "sleep_ms": 2}
    ) as loader:
        for trial in range(trials):
            loader.set_epoch(trial)
            at, kill = rng.randrange(1, len(loader) - 1), rng.random() < 0.3
            got = []
            try:
                for batch in loader:
                    got.append(batch.clone())
                    pids = loader.worker_pids()
                    if len(got) == at and pids:
                        victim = rng.choice(pids)
                        if kill:
                            os.kill(victim, signal.SIGKILL)
                        else:
                            os.kill(victim, signal.SIGSTOP)
                            t = threading.Timer(1.5, _resume, (victim,))
                            t.start()
                            timers.append(t)
            except hs.HindsightError as e:
                kinds[type(e).__name__] += 1
                continue
            want = data_synth.expected(loader.spec, trial)
            d, m = data_synth.audit(got, want)
            dups, missing = dups + d, missing + m
            if d or m:
                kinds["duplicated or missing examples"] += 1
            elif len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                kinds["batches differ from a run without failures"] += 1
        stats = loader.stats()
    for t in timers:
        t.join()
    print(
        f"input service: {trials} epochs, {dups} duplicated and {missing} missing examples; "
        f"failovers {stats['failovers']}, workers replaced {stats.get('workers_replaced', 0)}, "
        f"stale units dropped {stats['stale_dropped']}",
        flush=True,
    )
    return trials, kinds


NAMESAVER = textwrap.dedent(
    """
    import random, sys, time, torch, hindsight as hs
    s = hs.Store(sys.argv[1])
    me, rng = int(sys.argv[2]), random.Random(int(sys.argv[3]))
    ok = conflict = 0
    for i in range(1, 30):
        v = float(me * 1000 + i)
        # One saver slow (large arrays), one quick: saves overlap either way.
        n = 1 << (22 if me == 1 else 12)
        h = s.save("latest", {"a": torch.full((n,), v), "b": torch.full((7,), v), "v": v})
        time.sleep(rng.random() * 0.01)
        try:
            h.wait()
            ok += 1
        except hs.HindsightError as e:
            if "another save of this name" not in str(e):
                print("OTHER", type(e).__name__, e, flush=True)
                sys.exit(3)
            conflict += 1
    print("done", ok, conflict, flush=True)
    """
)


def same_name_saves(trials: int, base: Path, rng: random.Random) -> tuple[int, collections.Counter[str]]:
    kinds: collections.Counter[str] = collections.Counter()
    committed = refused = 0
    for t in range(trials):
        store = base / f"samename{t}"
        hs.Store(store)
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", NAMESAVER, str(store), str(me), str(rng.randrange(1 << 30))],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for me in (1, 2)
        ]
        deadline = time.monotonic() + 60
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            with contextlib.suppress(hs.HindsightError):
                state = hs.Store(store).load("latest")
                vals = {float(state["a"][0]), float(state["a"][-1]), float(state["b"][0]), float(state["v"])}
                if len(vals) != 1:
                    kinds["a mixed checkpoint"] += 1
            time.sleep(0.002)
        for p in procs:
            if p.poll() is None:
                p.kill()
                kinds["a saver hung"] += 1
            out, err = p.communicate()
            if p.returncode != 0:
                kinds[f"a saver failed otherwise (exit {p.returncode})"] += 1
                print(out[-300:], err[-300:], flush=True)
            elif out.startswith("done"):
                _, ok, lost = out.split()
                committed, refused = committed + int(ok), refused + int(lost)
        shutil.rmtree(store, ignore_errors=True)
    print(f"one name, two savers: {committed} saves committed, {refused} refused naming the conflict", flush=True)
    return trials, kinds


_HOSTILE = ["link/x", "link", ".", "./", "", "../up", "/etc/x", "a\0b", "x" * 300, "d/" * 2100 + "f", "train.py",
            ".hindsight/logs.db", "sub/../../up", "sub/./y", "a.py"]  # fmt: skip


def crafted_files(trials: int, base: Path, rng: random.Random) -> tuple[int, collections.Counter[str]]:
    from hindsight._run.files import put_back

    kinds: collections.Counter[str] = collections.Counter()
    for t in range(trials):
        root = base / f"files{t}"
        work, outside = root / "work", root / "OUTSIDE"
        work.mkdir(parents=True)
        outside.mkdir()
        (work / "link").symlink_to("../OUTSIDE")
        (work / "train.py").write_text("mine")
        (work / ".hindsight").mkdir()
        entry = rng.choice(_HOSTILE) if rng.random() < 0.8 else "".join(rng.choice("ab/.\0x") for _ in range(8))
        before = _tree(root)
        try:
            put_back({"good.txt": b"g", entry: b"evil"}, work, "ck", [work / "train.py", work / ".hindsight"])
            wrote = {k for k, v in _tree(root).items() if before.get(k) != v}
            if any(not k.startswith("work/") or k == "work/train.py" for k in wrote):
                kinds["wrote outside or over the script"] += 1
        except hs.HindsightError:
            if _tree(root) != before:
                kinds["refused but wrote"] += 1
        except Exception as e:  # any other exception is the finding
            kinds[f"unnamed {type(e).__name__}"] += 1
        shutil.rmtree(root, ignore_errors=True)
    return trials, kinds


RESUMED = textwrap.dedent(
    """
    import os, signal, time, torch, hindsight as hs
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    t0 = time.time()
    with hs.checkpointing(w=w, opt=opt):
        for epoch in hs.loop("epoch", range(6)):
            for step in hs.loop("step", range(3)):
                # HOLD: a resume waits, holding its run, until told to go.
                while os.environ.get("HOLD") and not os.path.exists("go") and time.time() < t0 + 90:
                    time.sleep(0.05)
                opt.zero_grad(); (w * w).sum().backward(); opt.step()
                time.sleep(0.05)
            if epoch == 2 and os.environ.get("STOP"):
                os.kill(os.getpid(), signal.SIGTERM)
    """
)


def concurrent_resumes(trials: int, base: Path, rng: random.Random) -> tuple[int, collections.Counter[str]]:
    kinds: collections.Counter[str] = collections.Counter()
    for t in range(trials):
        d = base / f"resume{t}"
        d.mkdir()
        (d / "train.py").write_text(RESUMED)
        env = {**os.environ, "HINDSIGHT_HOME": str(d / ".hindsight"), "HINDSIGHT_CHECKPOINT_EVERY": "1"}
        first = subprocess.run([sys.executable, "train.py"], cwd=d, env={**env, "STOP": "1"}, capture_output=True)
        if first.returncode != 85:
            kinds[f"the interrupted run exited {first.returncode}"] += 1
            continue
        # Both resumes overlap for sure: the one that holds the run waits in
        # its first step until the other has left (refused) or 60 s passed
        # (a second one let in waits too, and both then exit 0: a failure).
        # Without the wait, a loaded machine could finish the first before
        # the second started, and the trial tested nothing.
        procs = []
        for _ in range(2):
            procs.append(
                subprocess.Popen([sys.executable, "train.py"], cwd=d, env={**env, "HOLD": "1"}, stderr=subprocess.PIPE)
            )
            time.sleep(rng.random() * 0.3)
        deadline = time.monotonic() + 60
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        (d / "go").touch()
        codes, errs = [], []
        for p in procs:
            _, err = p.communicate(timeout=120)
            codes.append(p.returncode)
            errs.append(err.decode(errors="replace"))
        if sorted(codes) != [0, 2]:
            kinds[f"exit codes {sorted(codes)}"] += 1
        elif "held by another process" not in errs[codes.index(2)]:
            kinds["refused without naming the holder"] += 1
        shutil.rmtree(d, ignore_errors=True)
    return trials, kinds


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def rogue_workers(trials: int, base: Path, rng: random.Random) -> tuple[int, collections.Counter[str]]:
    sys.path.insert(0, str(REPO / "tests"))
    import data_synth

    kinds: collections.Counter[str] = collections.Counter()
    journal = base / "rogue-journal"
    with socket_port() as port:
        d = subprocess.Popen(
            [sys.executable, "-m", "hindsight", "data", "dispatcher", "--journal", str(journal), "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    assert d.stdout is not None
    d.stdout.readline()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HINDSIGHT_DATA_TOKEN")}
    good = {**env, "HINDSIGHT_DATA_TOKEN_FILE": str(journal / "token"),
            "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), *sys.path])}  # fmt: skip
    worker = [sys.executable, "-m", "hindsight", "data", "worker", "--dispatcher", f"127.0.0.1:{port}",
              "--dataset", "data_synth:make", "--args", '{"n": 160, "sleep_ms": 2}']  # fmt: skip
    workers = [subprocess.Popen(worker, env=good, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    rss0 = _rss_mib(d.pid)
    saved = os.environ.get("HINDSIGHT_DATA_TOKEN_FILE")
    os.environ["HINDSIGHT_DATA_TOKEN_FILE"] = good["HINDSIGHT_DATA_TOKEN_FILE"]
    try:
        with hs.data.Loader(
            data_synth.make, batch_size=8, seed=1, workers=f"127.0.0.1:{port}", dataset_args={"n": 160, "sleep_ms": 2}
        ) as loader:
            for trial in range(trials):
                rogues = [
                    subprocess.Popen(
                        worker,
                        env={**good, "HINDSIGHT_DATA_TOKEN": f"rogue-{rng.randrange(1 << 120):030x}"}
                        if rng.random() < 0.5
                        else {**env, "PYTHONPATH": good["PYTHONPATH"]},
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                    for _ in range(8)
                ]
                loader.set_epoch(trial)
                got = [b.clone() for b in loader]
                want = data_synth.expected(loader.spec, trial)
                if len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                    kinds["an epoch differs"] += 1
                for r in rogues:
                    _, err = r.communicate(timeout=60)
                    if r.returncode == 0 or "token" not in err or "Traceback" in err:
                        kinds["a rogue worker was not refused by name"] += 1
        if _rss_mib(d.pid) - rss0 > 64:
            kinds["the dispatcher grew by more than 64 MiB"] += 1
    finally:
        if saved is None:
            os.environ.pop("HINDSIGHT_DATA_TOKEN_FILE", None)
        else:
            os.environ["HINDSIGHT_DATA_TOKEN_FILE"] = saved
        for p in [*workers, d]:
            p.kill()
            p.wait()
    return trials, kinds


@contextlib.contextmanager
def socket_port() -> Iterator[int]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield port


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short run of each (what CI runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-fuzz", action="store_true", help="skip the cargo fuzzer (no Rust toolchain)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    q = args.quick
    rows = []
    with tempfile.TemporaryDirectory(prefix="hindsight-chaos-") as tmp:
        base = Path(tmp)
        rows.append(("kill -9 during save/remove/gc", *kill9(5 if q else 60, base, rng)))
        rows.append(("gc loop vs 2 replacing writers", *gc_vs_writers(8 if q else 60, base)))
        rows.append(("flip / truncate / delete one file", *corruption(30 if q else 400, base, rng)))
        if not args.no_fuzz:
            rows.append(("mutated, re-signed manifests", *fuzz(200 if q else 5000)))
        rows.append(("unreadable manifests, symlinked dirs", *store_hazards(10 if q else 200, base, rng)))
        rows.append(("another user's store", *other_users_store(5 if q else 100, base, rng)))
        rows.append(("input service: kill/stop workers", *data_workers(4 if q else 1000, rng)))
        rows.append(("one name, two savers", *same_name_saves(2 if q else 40, base, rng)))
        rows.append(("crafted files entries", *crafted_files(30 if q else 1000, base, rng)))
        rows.append(("two resumes of one run at once", *concurrent_resumes(1 if q else 10, base, rng)))
        rows.append(("rogue workers and a flood", *rogue_workers(1 if q else 20, base, rng)))
    print(f"\n{'experiment':<36} {'trials':>7} {'failures':>9}  failure kinds")
    failed = 0
    for name, trials, kinds in rows:
        n = sum(kinds.values())
        failed += n
        print(f"{name:<36} {trials:>7} {n:>9}  {', '.join(f'{k} x{v}' for k, v in kinds.items()) or '-'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Files the training writes and reads back (a best-model file, a metrics
CSV) are kept with the checkpoints: a resume finds them as they were at the
checkpoint, and each replay worker writes into a directory of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hindsight._run import files

from conftest import hindsight_cmd

SCRIPT = """\
import os, signal
import torch
import hindsight as hs

torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.05)
data = torch.randn(64, 4)
target = data.sum(1, keepdim=True)
best = None
with hs.checkpointing(model=net, optimizer=opt):
    for epoch in hs.loop("epoch", range(4)):
        with open("metrics.csv", "a") as f:  # before the steps: re-run by a resume
            f.write(f"{epoch}\\n")
        for step in hs.loop("step", range(8)):
            x, y = data[step * 8:(step + 1) * 8], target[step * 8:(step + 1) * 8]
            loss = (net(x) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if os.environ.get("SIGNAL_AT") == f"{epoch}.{step}" and not os.path.exists(os.environ["MARK"]):
                open(os.environ["MARK"], "w").close()
                os.kill(os.getpid(), signal.SIGUSR1)
        val = (net(data) - target).pow(2).mean().item()
        if best is None or val < best - 0.5 or epoch == 1:
            best = val
            torch.save(net.state_dict(), "best.pt")
        hs.log("val", val)
model = torch.nn.Linear(4, 1)
model.load_state_dict(torch.load("best.pt"))
hs.log("best_loss", (model(data) - target).pow(2).mean().item())
with open("metrics.csv") as f:
    hs.log("rows", f.read())
torch.save(net.state_dict(), os.environ.get("FINAL", "final.pt"))  # absolute: no mirror can redirect it
"""


def _run(script: Path, home: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "HINDSIGHT_HOME": str(home), "HINDSIGHT_CHECKPOINT_EVERY": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=script.parent,
    )


def _values(home: Path, *names: str) -> list[tuple]:
    code = (
        "import json, sys, hindsight as hs\n"
        "df = hs.dataframe(*sys.argv[1:])\n"
        "print(df.drop(columns=['run']).to_json(orient='values'))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, *names],
        env={**os.environ, "HINDSIGHT_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    import json

    return sorted(tuple(map(str, row)) for row in json.loads(r.stdout))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[tuple]:
    root = tmp_path_factory.mktemp("ref")
    (root / "train.py").write_text(SCRIPT)
    r = _run(root / "train.py", root / ".hindsight")
    assert r.returncode == 0, r.stderr
    return _values(root / ".hindsight", "val", "best_loss", "rows")


@pytest.mark.parametrize("at", ["2.3", "1.0"])
def test_a_resume_finds_the_files_as_they_were_at_its_checkpoint(tmp_path: Path, reference: list[tuple], at: str):
    """The metrics file is appended before the steps, which a mid-epoch
    resume re-runs: without the file put back, the row is there twice."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    home = tmp_path / ".hindsight"
    sig = {"SIGNAL_AT": at, "MARK": str(tmp_path / "signalled")}
    assert _run(script, home, **sig).returncode == 85
    r = _run(script, home, **sig)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "metrics.csv").read_text() == "0\n1\n2\n3\n"
    assert _values(home, "val", "best_loss", "rows") == reference


def test_replay_workers_write_files_of_their_own_and_leave_the_recorded_ones(
    tmp_path: Path, reference: list[tuple]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    home = tmp_path / ".hindsight"
    absolute = {"FINAL": str(tmp_path / "final.pt")}
    assert _run(script, home, **absolute).returncode == 0
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "best.pt", tmp_path / "metrics.csv")}
    script.write_text(
        SCRIPT.replace("            opt.step()\n", "            opt.step()\n            hs.log('l', loss.item())\n")
    )
    final = (tmp_path / "final.pt").read_bytes()

    def replay(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*hindsight_cmd(), "replay", str(script), "-q", *extra],
            env={**os.environ, "HINDSIGHT_HOME": str(home), **absolute},
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )

    # Workers at the same time would share final.pt: refused, naming it.
    r = replay("-j", "2", "--fast")
    assert r.returncode != 0 and "writes " + str(tmp_path / "final.pt") in r.stderr, r.stdout + r.stderr
    # One at a time (the recording's threads fill this machine's cores).
    r = replay("-j", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "best.pt", tmp_path / "metrics.csv")}
    assert after == before
    assert (tmp_path / "final.pt").read_bytes() == final  # put back as recorded when the worker exits
    assert _values(home, "val", "best_loss", "rows") == reference
    assert len(_values(home, "l")) == 32


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("link/evil.txt", "symbolic link"),
        ("link/newdir/x.txt", "symbolic link"),
        ("", "is empty"),
        (".", "directory itself"),
        ("./", "directory itself"),
        ("train.py", "would overwrite"),
        (".hindsight/logs.db", "would overwrite"),
        ("../escape.txt", "leaves the working directory"),
        ("a\0b.txt", "holds a NUL"),
        ("x" * 300, "longer than 255 bytes"),
        ("d/" * 2100 + "f", "longer than a path can be"),
    ],
)
def test_a_crafted_files_entry_is_refused_naming_it_and_nothing_is_written(
    tmp_path: Path, entry: str, says: str
) -> None:
    """A checkpoint is data: its `files` entries are put back under the
    working directory only, never through a link, never over the script or
    the project home, and all or none."""
    from hindsight._run.files import put_back
    from hindsight.errors import HindsightError

    work, outside = tmp_path / "work", tmp_path / "OUTSIDE"
    work.mkdir()
    outside.mkdir()
    (work / "link").symlink_to("../OUTSIDE")
    (work / "train.py").write_text("print('mine')\n")
    (work / ".hindsight").mkdir()
    with pytest.raises(HindsightError) as e:
        put_back({"good.txt": b"x", entry: b"evil"}, work, "ck1", [work / "train.py", work / ".hindsight"])
    shown = entry.replace("\0", "\\0")  # as the engine quotes it
    assert repr(entry) in str(e.value) or f'"{shown}"' in str(e.value), e.value
    assert says in str(e.value) and "ck1" in str(e.value), e.value
    assert not (work / "good.txt").exists()
    assert list(outside.iterdir()) == [] and not (tmp_path / "escape.txt").exists()
    assert (work / "train.py").read_text() == "print('mine')\n"


def test_a_resume_refuses_to_write_a_kept_file_through_a_link(tmp_path: Path) -> None:
    """The recorded metrics file, replaced by a link to a file elsewhere
    before the resume: the resume stops naming it, and the checkpoint's
    copy is written neither where the link points nor over the link."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    home = tmp_path / ".hindsight"
    sig = {"SIGNAL_AT": "2.3", "MARK": str(tmp_path / "signalled")}
    assert _run(script, home, **sig).returncode == 85
    elsewhere = tmp_path / "elsewhere.csv"
    elsewhere.write_text("not yours\n")
    (tmp_path / "metrics.csv").unlink()
    (tmp_path / "metrics.csv").symlink_to(elsewhere)
    r = _run(script, home, **sig)
    assert r.returncode != 0
    assert "metrics.csv" in r.stderr and "symbolic link" in r.stderr, r.stderr[-2000:]
    # The checkpoint's rows ("0", "1") were not written there; the script's
    # own append before its steps went where the user's link points.
    assert elsewhere.read_text().startswith("not yours\n") and "0\n1\n" not in elsewhere.read_text()
    assert (tmp_path / "metrics.csv").is_symlink()


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"paths": ["a.txt", "b.txt"], "data": [b"x"]}, "lists 2 paths and 1 contents"),
        ({"paths": "a.txt", "data": [b"x"]}, "not a list of paths"),
        ({"paths": [7], "data": [b"x"]}, "7 is not a path with bytes"),
        ({"paths": ["a.txt"], "data": ["text"]}, "'a.txt' is not a path with bytes"),
        ([b"x"], "not a list of paths"),
    ],
)
def test_a_malformed_files_entry_is_a_named_corrupt_error(entry: object, says: str) -> None:
    """Issue 42, item 8: a crafted checkpoint's `files` entry (lengths that
    do not match, other types) is one named error, not a traceback."""
    from hindsight._run.files import files_of
    from hindsight.errors import CorruptError

    with pytest.raises(CorruptError, match="checkpoint 'ck1'") as e:
        files_of(entry, "ck1")
    assert says in str(e.value), e.value


BYPASS = """\
import os, signal, subprocess, tempfile
import torch
import hindsight as hs

torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.05)
with hs.checkpointing(model=net, optimizer=opt):
    for epoch in hs.loop("epoch", range(4)):
        # Before the steps (re-run by a mid-epoch resume), and never through
        # a Python `open` of the file: an atomic rename of a temporary file
        # from $TMPDIR, a subprocess appending, a hard link.
        old = open("atomic.txt").read() if os.path.exists("atomic.txt") else ""
        fd, tmp = tempfile.mkstemp()
        os.write(fd, (old + f"{epoch}\\n").encode())
        os.close(fd)
        os.replace(tmp, "atomic.txt") if os.stat(tmp).st_dev == os.stat(".").st_dev else subprocess.run(["mv", tmp, "atomic.txt"], check=True)
        subprocess.run(["sh", "-c", f"echo {epoch} >> sub.txt"], check=True)
        if os.path.exists("linked.txt"):
            os.unlink("linked.txt")
        os.link("atomic.txt", "linked.txt")
        for step in hs.loop("step", range(4)):
            loss = net(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if os.environ.get("SIGNAL_AT") == f"{epoch}.{step}" and not os.path.exists(os.environ["MARK"]):
                open(os.environ["MARK"], "w").close()
                os.kill(os.getpid(), signal.SIGUSR1)
"""


def test_files_written_without_python_opening_them_are_kept_too(tmp_path: Path) -> None:
    """Issue 42, item 5: a rename over a file, a subprocess writing and a
    hard link are seen (the working directory is compared with its start
    at each checkpoint), so a mid-epoch resume finds each file as it was at
    its checkpoint instead of with that epoch's line twice."""
    script = tmp_path / "train.py"
    script.write_text(BYPASS)
    home = tmp_path / ".hindsight"
    sig = {"SIGNAL_AT": "2.1", "MARK": str(tmp_path / "signalled")}
    r = _run(script, home, **sig)
    assert r.returncode == 85, r.stderr
    r = _run(script, home, **sig)
    assert r.returncode == 0, r.stderr
    for name in ("atomic.txt", "sub.txt", "linked.txt"):
        assert (tmp_path / name).read_text() == "0\n1\n2\n3\n", name


def test_a_log_another_writer_appends_is_named_and_never_rewound(tmp_path: Path) -> None:
    """The job's own log in the working directory (Slurm's --output, a
    shell's `> run.log`) changes at every checkpoint, but it is written by
    its redirect, not the training: it is named, never put back, so the
    resumed attempt's lines land after the first attempt's (putting it back
    would rewind it and cut the writer off: the Slurm preemption test's log
    lost its second attempt)."""
    script = tmp_path / "train.py"
    script.write_text(
        BYPASS.replace(
            "            opt.step()\n", "            opt.step()\n            print('step', epoch, step, flush=True)\n"
        )
    )
    env = {**os.environ, "HINDSIGHT_HOME": str(tmp_path / ".hindsight"), "HINDSIGHT_CHECKPOINT_EVERY": "1"}
    env |= {"SIGNAL_AT": "2.1", "MARK": str(tmp_path / "signalled")}
    log = tmp_path / "run.log"
    codes = []
    for _ in range(2):
        with open(log, "a") as out:
            codes.append(
                subprocess.run(
                    [sys.executable, str(script)],
                    env=env,
                    stdout=out,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=tmp_path,
                    timeout=120,
                )
            )
    assert [r.returncode for r in codes] == [85, 0], codes[-1].stderr
    lines = log.read_text().splitlines()
    # Every step once, in order: the first attempt's lines, then the resumed one's.
    assert lines == [f"step {e} {s}" for e in range(4) for s in range(4)], lines
    assert "run.log, which another process writes" in codes[-1].stderr, codes[-1].stderr


RACE = """\
import os, sys, time
from pathlib import Path
from hindsight._run import files
recorded, own, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
os.chdir(own)
m = files.Mirror(recorded, own, [], False)
while not go.exists():
    time.sleep(0.001)
with open("log/sub/log.txt", "a"):  # as a rank's script writes it
    pass
"""


def test_the_ranks_of_a_replay_worker_make_one_path_their_own_at_once_without_tripping(tmp_path: Path) -> None:
    """A replay worker's ranks share its mirror of the recorded directory,
    and build-nanogpt truncates its log file on every rank before training:
    each write first makes the linked directories and file real. Four
    processes doing so for one path at the same instant all succeed (one
    failed with FileExistsError in a CI run), the file ends a copy of the
    recorded one, and the recorded tree is untouched."""
    recorded = tmp_path / "recorded"
    (recorded / "log" / "sub").mkdir(parents=True)
    (recorded / "log" / "sub" / "log.txt").write_text("recorded\n")
    (recorded / "log" / "other.txt").write_text("other\n")
    script = tmp_path / "race.py"
    script.write_text(RACE)
    for trial in range(8):
        own, go = tmp_path / f"cwd-{trial}", tmp_path / f"go-{trial}"
        files.mirror(recorded, own)
        procs = [
            subprocess.Popen([sys.executable, str(script), str(recorded), str(own), str(go)], stderr=subprocess.PIPE)
            for _ in range(4)
        ]
        time.sleep(0.5)  # all four waiting at the start line
        go.touch()
        for p in procs:
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err.decode()[-2000:]
        got = own / "log" / "sub" / "log.txt"
        assert not (own / "log").is_symlink() and not got.is_symlink()
        assert got.read_text() == "recorded\n" and (own / "log" / "other.txt").read_text() == "other\n"
    assert (recorded / "log" / "sub" / "log.txt").read_text() == "recorded\n"
    assert not (recorded / "log").is_symlink()


SPIN = """\
import os, sys, time
own, stop = sys.argv[1], sys.argv[2]
tries = failed = 0
deadline = time.monotonic() + 60
print("ready", flush=True)
while not os.path.exists(stop) and time.monotonic() < deadline:
    tries += 1
    try:
        os.makedirs(os.path.join(own, "log"), exist_ok=True)  # build-nanogpt, on every rank
    except FileExistsError:
        failed += 1
print(tries, failed)
"""


def test_a_rank_making_a_mirrored_directory_never_finds_it_missing_while_another_makes_it_real(
    tmp_path: Path,
) -> None:
    """`os.makedirs(d, exist_ok=True)` runs mkdir, then `isdir(d)` when mkdir
    says it exists. Another rank turning the linked `d` into a real directory
    at that instant must never leave `d` missing, or the first rank's script
    dies with FileExistsError (build-nanogpt's 2-rank replay did in CI).
    300 swaps against a rank spinning on makedirs: not one failure."""
    recorded, own, stop = tmp_path / "recorded", tmp_path / "own", tmp_path / "stop"
    (recorded / "log").mkdir(parents=True)
    (recorded / "log" / "log.txt").write_text("recorded\n")
    own.mkdir()
    os.symlink(recorded / "log", own / "log")
    probe = tmp_path / "probe"
    os.symlink(recorded / "log", probe)
    if not files._exchange(probe, own / "log"):
        pytest.skip("this file system has no atomic exchange (renameat2): the fallback leaves a window")
    files._exchange(probe, own / "log")
    spinner = subprocess.Popen([sys.executable, "-c", SPIN, str(own), str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        assert spinner.stdout is not None and spinner.stdout.readline().strip() == "ready"
        for i in range(300):
            files._replace_link_with_mirror(own / "log", recorded / "log")
            assert (own / "log").is_dir() and not (own / "log").is_symlink()
            assert (own / "log" / "log.txt").read_text() == "recorded\n"
            # Linked again for the next round, also without a moment missing.
            relink = tmp_path / f"relink-{i}"
            os.symlink(recorded / "log", relink)
            assert files._exchange(relink, own / "log")
            for entry in relink.iterdir():
                entry.unlink()
            relink.rmdir()
    finally:
        stop.touch()
        out, _ = spinner.communicate(timeout=90)
    tries, failed = map(int, out.split())
    assert tries > 300 and failed == 0, out
    assert sorted(p.name for p in recorded.iterdir()) == ["log"] and (recorded / "log" / "log.txt").is_file()


WATCH = """\
import os, sys
from hindsight import _native
seen = []
def watcher(path, mode, flags):
    if str(path).endswith("refused"):
        raise PermissionError(f"not here: {path}")
    seen.append((os.path.basename(str(path)), mode))
_native.watch_opens(watcher)
for _ in range(1000):
    id(seen)  # an audit event (builtins.id) the watcher is not called for
open("a.txt", "w").close()
fd = os.open("b.txt", os.O_WRONLY | os.O_CREAT)
os.close(fd)
try:
    open("refused", "w")
except PermissionError as e:
    print("refused:", e, os.path.exists("refused"))
try:
    _native.watch_opens(watcher)
except RuntimeError as e:
    print("again:", e)
print(seen)
"""


def test_the_open_watcher_sees_every_open_and_can_refuse_one(tmp_path: Path) -> None:
    """The native audit hook hands the watcher each `open` (builtins.open,
    os.open) and nothing else; an exception from the watcher refuses the
    open before the file exists (how a replay worker stops a write into the
    recorded directory); a process has one watcher."""
    r = subprocess.run([sys.executable, "-c", WATCH], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "refused: not here: refused False"
    assert lines[1].startswith("again: watch_opens: this process already has its open watcher")
    assert lines[2] == "[('a.txt', 'w'), ('b.txt', None)]"

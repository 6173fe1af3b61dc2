"""Files a training run writes and may read back (the LSTM's best model,
nanoGPT's ckpt.pt, timm's summary.csv): kept with the checkpoints, put back
when one is restored, and never shared between replay workers.

Recording: an audit hook sees every `open` for writing (builtins.open,
os.open, numpy, csv); `torch.save` to a path opens it in C++, so it is
wrapped to say so too. A file under the working directory is kept, by its
path relative to it, with every later checkpoint (the store deduplicates
unchanged content); a file written elsewhere is named in a note at the end.

Replay: each worker runs in a mirror of the recorded working directory made
of symbolic links. Before a write, the links on its path become a real
directory and file (copy on write), so a worker writes neither into the
recorded tree nor into another worker's. A write the mirror cannot redirect
(an absolute path into the recorded directory) stops the worker, naming it.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import fcntl
import functools
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hindsight import _native, _settings
from hindsight.errors import CorruptError, ReplayError

#: Set in a replay worker: the recorded working directory its own mirrors.
ENV_RECORDED_CWD = _settings.RECORDED_CWD
#: "1" when other workers of the same replay may run at the same time.
ENV_CONCURRENT = _settings.REPLAY_CONCURRENT

#: A file larger than this is not kept (a framework's own checkpoint files
#: would double the store and its hashing at every checkpoint): it is named
#: in the note at the end of the run instead.
MAX_FILE_BYTES = 64 << 20

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
# The one watcher of the process (an audit hook cannot be removed).
_WATCHER: list[Callable[[Path, bool], None]] = []


_busy = threading.local()


def _audit_open(path: Any, mode: Any, flags: Any) -> None:
    """Called for each `open` audit event (the native hook filters the
    others out in C: a Python hook would be called for every event, such
    as the optimizer's `builtins.id`, at about 90 ns each)."""
    if not _WATCHER or getattr(_busy, "on", False):
        return
    _busy.on = True  # a watcher that opens a file must not see its own open
    try:
        _opened(path, mode, flags)
    finally:
        _busy.on = False


def _opened(path: Any, mode: Any, flags: Any) -> None:
    if isinstance(path, int) or path is None:
        return
    if isinstance(mode, str):
        writes, keeps = any(c in mode for c in "wax+"), "a" in mode or "+" in mode
    else:
        writes = isinstance(flags, int) and bool(flags & _WRITE_FLAGS)
        keeps = writes and not flags & os.O_TRUNC
    if writes:
        _WATCHER[0](Path(os.path.abspath(os.fsdecode(path))), keeps)


def _watch(callback: Callable[[Path, bool], None]) -> None:
    if not getattr(sys, "_hindsight_audit", False):
        _native.watch_opens(_audit_open)
        sys._hindsight_audit = True  # type: ignore[attr-defined]
    _WATCHER[:] = [callback]
    torch: Any = sys.modules.get("torch")
    if torch is not None and not getattr(torch.save, "_hindsight", False):
        original = torch.save

        @functools.wraps(original)
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(f, (str, bytes, os.PathLike)) and _WATCHER:
                _WATCHER[0](Path(os.path.abspath(os.fsdecode(f))), False)
            return original(obj, f, *args, **kwargs)

        save._hindsight = True  # type: ignore[attr-defined]
        torch.save = save


def _ignored(p: Path) -> bool:
    return "__pycache__" in p.parts or p.suffix == ".pyc"


#: A scan of the working directory stops after this many entries or this
#: many seconds (a dataset unpacked there): the files Python opens for
#: writing are still kept, and the end note says the scan was cut short.
MAX_SCAN_ENTRIES = 5_000
MAX_SCAN_SECONDS = 0.02
# Version control, caches and environments: never the training's output.
_SKIPPED_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        "__pycache__",
        ".venv",
        "venv",
        "node_modules",
        ".mypy_cache",
        ".ruff_cache",
        ".pytest_cache",
    }
)


def _held_open(paths: list[Path]) -> set[Path]:
    """Of `paths`, those another process holds open for writing, or that
    are this process's own stdout or stderr: a batch system's job log, a
    shell's redirect, a `tee`. Putting such a file back would cut its
    writer off (an atomic rename leaves it writing to the old file)."""
    keys: dict[tuple[int, int], Path] = {}
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            continue
        keys[(st.st_dev, st.st_ino)] = p
    found: set[Path] = set()
    for own in (1, 2):
        try:
            st = os.fstat(own)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in keys:
            found.add(keys[(st.st_dev, st.st_ino)])
    by_name = {str(p): p for p in keys.values()}
    me = str(os.getpid())
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit() and d != me]
    except OSError:
        return found
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for entry in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{entry}")
            except OSError:
                continue
            if target not in by_name:
                continue
            try:
                with open(f"/proc/{pid}/fdinfo/{entry}") as f:
                    flags = next(int(line.split()[1], 8) for line in f if line.startswith("flags:"))
            except (OSError, StopIteration, ValueError):
                flags = os.O_WRONLY  # cannot tell: assume it writes
            if flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
                found.add(by_name[target])
    return found


def _scan(root: Path, exclude: list[Path]) -> tuple[dict[str, tuple[int, int]], bool]:
    """{relative path: (size, mtime_ns)} of the regular files under `root`
    (links and what they point to left out), and whether the scan finished
    within its bounds."""
    out: dict[str, tuple[int, int]] = {}
    deadline = time.monotonic() + MAX_SCAN_SECONDS
    seen = 0
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for e in it:
                seen += 1
                if seen > MAX_SCAN_ENTRIES or time.monotonic() > deadline:
                    return out, False
                try:
                    if e.is_symlink():
                        continue
                    if e.is_dir():
                        p = Path(e.path)
                        if e.name not in _SKIPPED_DIRS and not any(p == x or p.is_relative_to(x) for x in exclude):
                            stack.append(p)
                    elif e.is_file() and not e.name.endswith((".py", ".pyc")):  # source is never put back
                        st = e.stat()
                        out[Path(e.path).relative_to(root).as_posix()] = (st.st_size, st.st_mtime_ns)
                except OSError:
                    continue
    return out, True


class Written:
    """Recording: the files written under `root`, kept with each checkpoint."""

    def __init__(self, root: Path, exclude: list[Path]):
        self.root = root.resolve()
        self.exclude = [e.resolve() for e in exclude]
        self.kept: dict[str, None] = {}  # relative paths, in the order first written
        self.outside: dict[str, None] = {}
        self.too_large: dict[str, None] = {}
        # Read here, never in the hook: gettempdir() may open a file under a lock.
        self.temp = Path(tempfile.gettempdir()).resolve()
        self._read: dict[str, tuple[tuple[int, int], bytes]] = {}
        # What the directory held when the run started: a file that differs
        # from it at a checkpoint was written by the run, however (a rename
        # over it, a subprocess, a library writing from C or Rust, a link).
        self._before, self.scanned = _scan(self.root, self.exclude)
        # Changed files another process writes (named, never put back).
        self.elsewhere: dict[str, None] = {}
        _watch(self._opened)

    def _changed(self) -> None:
        """Keep the files the directory holds that differ from its start."""
        if not self.scanned:
            return
        now, self.scanned = _scan(self.root, self.exclude)
        new = [
            rel
            for rel, key in now.items()
            if self._before.get(rel) != key and rel not in self.kept and rel not in self.elsewhere
        ]
        if not new:
            return
        held = _held_open([self.root / rel for rel in new])
        for rel in new:
            if self.root / rel in held:
                self.elsewhere.setdefault(rel)
            else:
                self.kept.setdefault(rel)

    def _opened(self, path: Path, keeps: bool) -> None:
        p = path.resolve()
        if _ignored(p) or any(p.is_relative_to(e) for e in self.exclude):
            return
        if p.is_relative_to(self.root):
            self.kept.setdefault(p.relative_to(self.root).as_posix())
        elif not p.is_relative_to(self.temp) and p.parts[:2] != ("/", "dev"):
            self.outside.setdefault(str(p))

    def capture(self) -> dict[str, bytes]:
        """{relative path: content} of the kept files that exist now. A file
        is read again only when its size or modification time changed."""
        self._changed()
        out: dict[str, bytes] = {}
        for rel in self.kept:
            try:
                st = (self.root / rel).stat()
            except FileNotFoundError:
                continue  # removed since: nothing to put back
            if not stat.S_ISREG(st.st_mode):
                continue
            if st.st_size > MAX_FILE_BYTES:
                self.too_large.setdefault(rel)
                continue
            key = (st.st_mtime_ns, st.st_size)
            seen = self._read.get(rel)
            if seen is None or seen[0] != key:
                seen = (key, (self.root / rel).read_bytes())
                self._read[rel] = seen
            out[rel] = seen[1]
        return out

    def note(self) -> str | None:
        def some(names: list[str]) -> str:
            return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

        why = []
        if self.outside:
            why.append(f"{some(list(self.outside))}, outside its working directory {self.root}")
        if self.too_large:
            why.append(f"{some(list(self.too_large))}, larger than {MAX_FILE_BYTES >> 20} MiB")
        if self.elsewhere:
            why.append(f"{some(list(self.elsewhere))}, which another process writes (a job log, a redirect)")
        if not self.scanned:
            why.append(
                f"files in {self.root} not opened from Python, which could not all be compared (more than "
                f"{MAX_SCAN_ENTRIES} entries, or longer than {MAX_SCAN_SECONDS * 1000:.0f} ms to list)"
            )
        if not why:
            return None
        return (
            f"hindsight: note: the run wrote {'; and '.join(why)}: checkpoints do not keep such files, "
            "so a resume or replay finds them as they are then"
        )


class Mirror:
    """Replay worker: its working directory `own` mirrors `recorded`.

    A write through an absolute path into the recorded directory cannot be
    redirected. A worker alone is allowed it: the content of a file that
    existed is kept aside at the first write and put back when the worker
    exits (a file it creates stays: a replay adds, never changes). With
    other workers running at the same time it is refused: they would read
    each other's files."""

    def __init__(self, recorded: Path, own: Path, exclude: list[Path], concurrent: bool):
        self.recorded, self.own = recorded.resolve(), own.resolve()
        self.exclude = [e.resolve() for e in exclude]
        self.concurrent = concurrent
        self.originals: dict[Path, bytes | None] = {}
        self.holding = False
        _watch(self._opened)
        atexit.register(self.put_back_originals)

    def _opened(self, path: Path, keeps: bool) -> None:
        if path.is_relative_to(self.own):
            self.materialize(path, keeps)
            return
        real = path.resolve()
        if not real.is_relative_to(self.recorded) or any(real.is_relative_to(e) for e in self.exclude):
            return
        if self.concurrent:
            raise ReplayError(
                f"the replayed script writes {path}, inside the recorded working directory {self.recorded}, "
                "while other replay workers run: they would read each other's file. Give the script a path "
                "relative to its working directory (each worker has its own), or replay with -j 1"
            )
        if real not in self.originals:
            self.originals[real] = real.read_bytes() if real.is_file() else None

    def put_back_originals(self) -> None:
        """The recorded directory as the recording left it."""
        for real, data in self.originals.items():
            if data is not None:
                tmp = real.with_name(f".{real.name}.hindsight-restore")
                tmp.write_bytes(data)
                os.replace(tmp, real)
        self.originals.clear()

    def materialize(self, path: Path, keeps: bool) -> None:
        """Make `path`'s directories real and `path` a file of its own (a
        copy of the linked one when the write keeps content: append, r+).
        The ranks of a replay worker share its mirror, and all of them may
        write one path at once (build-nanogpt truncates its log on every
        rank): one at a time, each looking again under the lock."""
        if self.holding:  # a copy's own open, seen again: already under the lock
            self._materialize(path, keeps)
            return
        lock = self.own.parent / f"{self.own.name}.lock"
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            self.holding = True
            try:
                self._materialize(path, keeps)
            finally:
                self.holding = False

    def _materialize(self, path: Path, keeps: bool) -> None:
        cur = self.own
        for part in path.relative_to(self.own).parts[:-1]:
            cur = cur / part
            if cur.is_symlink():
                target = Path(os.readlink(cur))
                if not target.is_relative_to(self.recorded) or not target.is_dir():
                    return  # a link of the user's own (data elsewhere): written where it points
                _replace_link_with_mirror(cur, target)
        if path.is_symlink():
            target = Path(os.readlink(path))
            if not target.is_relative_to(self.recorded):
                return
            path.unlink()
            if keeps and target.is_file():
                shutil.copyfile(target, path)


_MIRROR: list[Mirror] = []


def mirror_worker(home: Path | None = None) -> None:
    """In a replay worker (`$HINDSIGHT_RECORDED_CWD` set), redirect writes
    into this worker's mirror from now on: called as hindsight is imported,
    so a script that truncates its log file before its first `hs.*` call
    (build-nanogpt's `open(log_file, "w")`) does not empty the recording's.
    `home`: the project home, never redirected (once known)."""
    recorded = _settings.text(ENV_RECORDED_CWD)
    if not recorded:
        return
    if not _MIRROR:
        env_home = _settings.text(_settings.HOME)
        _MIRROR.append(
            Mirror(
                Path(recorded),
                Path.cwd(),
                [Path(env_home)] if env_home else [],
                _settings.flag(ENV_CONCURRENT, False),
            )
        )
    if home is not None and home.resolve() not in _MIRROR[0].exclude:
        _MIRROR[0].exclude.append(home.resolve())


def _replace_link_with_mirror(link: Path, target: Path) -> None:
    """`link` (a mirrored directory's link) becomes a real directory of links
    to `target`'s entries. Built aside first, then swapped in by one atomic
    exchange: another rank running `os.makedirs(link, exist_ok=True)` outside
    our lock (build-nanogpt does, on every rank) checks `isdir` after its
    mkdir fails, and must never find the path missing (FileExistsError)."""
    aside = link.with_name(f".{link.name}.hindsight-mirror-{os.getpid()}")
    mirror(target, aside)
    if _exchange(aside, link):
        aside.unlink()  # now the old link
        return
    # No exchange on this file system: unlink + rename leaves a window of two
    # system calls; a directory another process made in it is filled instead.
    link.unlink()
    try:
        os.rename(aside, link)
    except OSError:
        if not link.is_dir() or link.is_symlink():
            raise
        for entry in os.scandir(aside):
            if not os.path.lexists(link / entry.name):
                os.rename(entry.path, link / entry.name)
        shutil.rmtree(aside, ignore_errors=True)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


@functools.cache
def _renameat2() -> Any:
    """glibc's renameat2, or None (not Linux, or a libc without it)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Swap `a` and `b` atomically (renameat2 RENAME_EXCHANGE): False where
    the kernel or file system has no such call (EINVAL, ENOSYS), so the
    caller falls back; any other failure is raised."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def mirror(src: Path, dst: Path) -> None:
    """`dst` as a directory of links to each entry of `src`."""
    dst.mkdir(parents=True, exist_ok=True)
    for entry in os.scandir(src):
        os.symlink(entry.path, dst / entry.name)


def files_of(entry: Any, checkpoint: str) -> dict[str, bytes]:
    """A checkpoint's `files` entry ({"paths": [...], "data": [...]}) as
    path -> bytes, or a CorruptError naming the checkpoint and what is wrong
    (a crafted or damaged entry: nothing is written)."""
    paths = entry.get("paths") if isinstance(entry, dict) else None
    data = entry.get("data") if isinstance(entry, dict) else None
    if not isinstance(paths, list) or not isinstance(data, list):
        raise CorruptError(f"checkpoint {checkpoint!r}: its 'files' entry is not a list of paths and one of contents")
    if len(paths) != len(data):
        raise CorruptError(
            f"checkpoint {checkpoint!r}: its 'files' entry lists {len(paths)} paths and {len(data)} contents"
        )
    out: dict[str, bytes] = {}
    for p, d in zip(paths, data, strict=True):
        if not isinstance(p, str) or not isinstance(d, (bytes, bytearray, memoryview)):
            raise CorruptError(f"checkpoint {checkpoint!r}: its 'files' entry {p!r} is not a path with bytes")
        out[p] = bytes(d)
    return out


def put_back(files: dict[str, bytes], root: Path, checkpoint: str, protected: list[Path]) -> None:
    """Write a checkpoint's files under `root` (the run's or the worker's
    working directory), each atomically, never through a link and never
    over `protected` (the script, the project home) or Python source: all
    of them, or none and an error naming the entry (`runs::files`)."""
    if _WATCHER:
        # What an `open` of each would tell the watcher (a replay worker's
        # mirror makes the file its own instead of a link to the recorded one).
        for rel in files:
            if rel and not os.path.isabs(rel) and ".." not in Path(rel).parts:
                _WATCHER[0](Path(os.path.abspath(root / rel)), False)
    _native.put_back_files(root, files, [str(p) for p in protected], checkpoint)

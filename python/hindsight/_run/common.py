"""What recording and replaying share: the process's run (logs, arguments,
the loop stack, the objects given to `hs.checkpointing`, the store), and the
helpers that read the script, its source and its command line."""

from __future__ import annotations

import numbers
import os
import stat
import subprocess
import sys
import time
import types
from collections.abc import Iterable, Iterator, Sized
from pathlib import Path
from typing import Any, TypeVar

from hindsight import _native, _settings
from hindsight._run import batches, jupyter
from hindsight._run.counters import shift_enumerates
from hindsight._run.files import Written, files_of, put_back
from hindsight._run.logwriter import LogWriter, Row
from hindsight._run.loopvars import LoopVars, ModuleVars, _storages, stateful_objects
from hindsight._run.position import Position
from hindsight._run.ranks import Ranks
from hindsight._run.values import Values
from hindsight._state import apply_grads, apply_state, capture, set_rng_state
from hindsight.errors import InvalidArgumentError

T = TypeVar("T")

ENV_HOME = _settings.HOME
ENV_REPLAY = _settings.REPLAY
ENV_RUN_NAME = _settings.RUN_NAME
ENV_RESUME = _settings.RESUME
ENV_EXPLAIN = _settings.EXPLAIN  # set by `hindsight record --explain`


def job_part(state: dict[str, Any], grads_of_the_job: bool) -> dict[str, Any]:
    """Take out of a multi-rank checkpoint's ``state`` what is the job's,
    split between the ranks (the rest is each rank's own): the objects, and
    the gradients where they are laid out as the parameters are (FSDP's
    DTensors). Plain gradients are each rank's: between the micro-steps of
    gradient accumulation without synchronisation (``no_sync``,
    ``require_backward_grad_sync = False``) they differ by rank; equal ones
    (after the all-reduce) are stored once by the store's dedup."""
    shared = {"objects": state.pop("objects")}
    if "grads" in state and grads_of_the_job:
        shared["grads"] = state.pop("grads")
    return shared


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("hindsight")
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


#: The source snapshot's walk of the project stops at this many .py files,
#: directory entries or seconds: a project root that holds a dataset, or a
#: home set under a scratch directory (the project is then all of it), would
#: otherwise be walked to the end at every run's start (/tmp here: 37,000
#: directories, 0.4 s CPU). The script and the modules it imported from the
#: project come first, so a cut walk misses only files the run never ran.
MAX_SOURCE_FILES = 2000
MAX_SOURCE_ENTRIES = 20_000
MAX_SOURCE_SECONDS = 0.1
_SKIP_DIRS = {".git", ".hindsight", "__pycache__", "node_modules", "site-packages", ".venv", "venv", "build", "target"}


def _script_path() -> Path:
    """The run's script: the notebook in a Jupyter kernel (jupyter.py)."""
    nb, _ = jupyter.program()
    if nb is not None:
        return nb
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 and argv0 not in ("-c", "-m") and Path(argv0).exists():
        return Path(argv0).resolve()
    return Path.cwd().resolve() / "<interactive>"


def _snapshot_source(root: Path, script: Path, script_source: str | None = None) -> dict[str, str]:
    """The project's Python files as they are now (content-addressed by the db);
    ``script_source``: the script's text where it is not the file's (a notebook's cells)."""
    files: dict[str, str] = {}
    budget = 20 << 20
    candidates = [script] if script.exists() and script_source is None else []
    if script_source is not None:
        try:
            files[str(script.relative_to(root))] = script_source
        except ValueError:
            files[str(script)] = script_source
    candidates += _imported_from(root)
    entries, deadline = 0, time.monotonic() + MAX_SOURCE_SECONDS
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d
            for d in dirnames
            if d not in _SKIP_DIRS and not d.startswith(".") and not (Path(dirpath) / d / "pyvenv.cfg").exists()
        ]
        candidates += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
        entries += len(dirnames) + len(filenames)
        if len(candidates) > MAX_SOURCE_FILES or entries > MAX_SOURCE_ENTRIES or time.monotonic() > deadline:
            break
    for p in candidates:
        try:
            rel = str(p.relative_to(root))
        except ValueError:
            rel = str(p)
        if rel in files:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        budget -= len(text)
        if budget < 0:
            break
        files[rel] = text
    return files


def _imported_from(root: Path) -> list[Path]:
    """The Python files of the modules imported so far that lie under ``root``."""
    found = []
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None)
        if isinstance(f, str) and f.endswith(".py"):
            p = Path(f)
            if p.is_relative_to(root) and not _SKIP_DIRS.intersection(p.relative_to(root).parts):
                found.append(p)
    return sorted(found)


def _git(root: Path) -> tuple[str | None, bool | None]:
    if not (root / ".git").exists():
        return None, None
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    if commit.returncode != 0:
        return None, None
    return commit.stdout.strip(), bool(status.stdout.strip())


def inherited_pipe(fd: int) -> int | None:
    """The pipe a launcher handed down as descriptor ``fd`` (the
    supervisor's heartbeat, a replay worker's progress), open for writing;
    None where this process has none.

    torchrun closes inherited descriptors, so under ``python -m
    hindsight.torchrun`` (which sets $HINDSIGHT_PIPES_AT to its pid and
    keeps the pipes open) a rank reopens the launcher's own through /proc.
    A rank's descriptor of that number is then its own (a process group's
    socket), never written to; elsewhere only a pipe is."""
    try:
        at = _native.setting_value(_settings.PIPES_AT)
        if isinstance(at, int) and at != os.getpid():
            path = f"/proc/{at}/fd/{fd}"
            if not stat.S_ISFIFO(os.stat(path).st_mode):
                return None
            return os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        return fd if stat.S_ISFIFO(os.fstat(fd).st_mode) else None
    except (InvalidArgumentError, OSError):
        return None  # not ours (an inherited variable without the descriptor)


def _heartbeat_fd() -> int | None:
    """The pipe `hindsight run` watches for hangs, if this process has one.
    Also arranges that SIGUSR2 (sent before a hung process is killed) dumps
    every thread's Python stack to stderr."""
    try:
        fd = _native.setting_value(_settings.HEARTBEAT_FD)
    except InvalidArgumentError:
        return None
    if not isinstance(fd, int):
        return None
    fd = inherited_pipe(fd)
    if fd is None:
        return None
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, all_threads=True)
    return fd


#: The RNG states a checkpoint keeps per rank (see `RecordRun._save`).
_RNG_KEYS = ("rng", "iter_rng", "block_rng", "start_rng")


class Run:
    """The process's run, created by the first hs.* call: a `RecordRun` for a
    plain `python train.py`, a `ReplayRun` in a worker started by
    `hindsight replay`. This class holds what both do the same way; the
    loops call the hooks the two subclasses define.

    Why about 30 attributes: each is one of six groups the hooks all read,
    kept flat because the loops' hot path reads them per step. The run's
    identity (script, paths, home, root, db, run_id; world, ranks, leads,
    rank_index), its store (`_store` and the three locations it is chosen
    from), what it checkpoints (objects, hands_free, discovered, transient,
    module_vars, unkept), what it writes (logs, values, files), where its
    process stands (finished, past_plan, requeue, the heartbeat's two), and
    `pos`. What had a life of its own moved out: the position in the loops
    (`Position`), the values' buffering (`Values`), the log thread
    (`LogWriter`)."""

    #: "record" or "replay": the phase its log rows are written in.
    phase = "record"

    def __init__(self) -> None:
        # Under several ranks the job is one run: rank 0 owns it (its rows,
        # logs, decisions), the others join it as the outer loop starts and
        # follow (`ranks.py`, core `runs::ranks`).
        world = self.world = _native.launch_world()
        self.ranks = Ranks(world) if world is not None and world.size > 1 else None
        self.leads = self.ranks is None or self.ranks.leads
        if self.ranks is not None:
            self.rank_index = self.ranks.rank
        self.script = _script_path()
        self.paths = _native.project_paths(str(self.script.parent))
        self.home = Path(self.paths.home)
        self.root = self.home.parent
        self.db = _native.LogDb(self._log_db_path())  # creates the home durably if needed
        self.run_id = ""
        self._store: Any = None
        # Where checkpoints go: hs.checkpointing(store=, local_first=), else
        # $HINDSIGHT_STORE / $HINDSIGHT_LOCAL_FIRST, else <home>/store. Read at
        # the first store access, so hs.checkpointing may come after hs.arg.
        self.store_location: str | None = None
        self.local_first: str | None = None
        self.recorded_store: str | None = None
        self.args: dict[str, Any] = {}
        # What is logged, and the writes beside it, reach the database off
        # the training thread (`_write_logs` is a replay's own).
        self.logs = LogWriter(self._write_logs)
        # Where the script is in its loops: the loops move it, the hooks read it.
        self.pos = Position()
        # What hs.log and a framework's hooks log: contexts, occurrences, rows.
        self.values = Values(self.logs, self.ranks, self.leads, self.rank_index)
        self.objects: dict[str, Any] = {}
        # hs.checkpointing() without objects: they are found when the outer
        # loop starts (loopvars.stateful_objects), by name, with a line.
        self.hands_free = False
        self.discovered: dict[str, tuple[Any, int]] = {}
        # Loop variables whose value need not survive a resume (hs.checkpointing(transient=...)).
        self.transient: set[str] = set()
        # A replay worker whose plan ends before the loop does: the code after
        # the loop runs on the state of its last iteration, not the run's
        # final one, so what it logs is no result (the last worker's is).
        self.past_plan = False
        self.module_vars = ModuleVars()
        # Files the script writes under its working directory (files.py): kept by a recording.
        self.files: Written | None = None
        # Loop variables changed through methods that no checkpoint keeps
        # (LoopVars.unkept), for the closing note.
        self.unkept: dict[str, str] = {}
        self.finished = False
        # Set by hs.checkpointing; only recording acts on it.
        self.requeue = False
        self._beat_fd, self._next_beat = _heartbeat_fd(), 0.0

    def configure(
        self,
        every: int | None,
        safety_minutes: float | None,
        exit_code: int | None,
        retention: _native.Retention | None,
    ) -> None:
        """hs.checkpointing's settings for the session: only recording acts on them."""

    def _log_db_path(self) -> str:
        return str(self.paths.db)

    def heartbeat(self) -> None:
        """Tell `hindsight run` the loop is alive (a byte at most once per second)."""
        if self._beat_fd is None:
            return
        now = time.monotonic()
        if now < self._next_beat:
            return
        self._next_beat = now + 1.0
        try:
            os.write(self._beat_fd, b".")
        except OSError:
            self._beat_fd = None  # the supervisor is gone; training goes on

    # -- store -------------------------------------------------------------------
    def set_store(self, location: str | os.PathLike[str] | None, local_first: str | os.PathLike[str] | None) -> None:
        """hs.checkpointing(store=..., local_first=...): only before the store is first used."""
        loc = None if location is None else _native.store_location(os.fspath(location), "store")
        local = None if local_first is None else _native.store_location(os.fspath(local_first), "local_first", True)
        if (
            self._store is not None
            and (loc, local) != (self.store_location, self.local_first)
            and (loc is not None or local is not None)
        ):
            raise InvalidArgumentError(
                f"hs.checkpointing(store={location!r}): this run already uses the store {self._store.path}; "
                "give store= at the first hs.checkpointing of the script"
            )
        if loc is not None:
            self.store_location = loc
        if local is not None:
            self.local_first = local

    def _open_store(self) -> tuple[str, str | None]:
        """(store location, local-first directory or None) for this run."""
        raise NotImplementedError

    @property
    def store(self) -> Any:
        if self._store is None:
            from hindsight._store import Store

            location, local = self._open_store()
            self._store = Store(location, local_first=local)
            self.store_location, self.local_first = location, local
            if self.files is not None:
                # The store's own files are never "files the script wrote".
                self.files.exclude.extend(Path(p).resolve() for p in (location, local) if p and "://" not in p)
        return self._store

    # -- logs --------------------------------------------------------------------
    def _write_logs(self, rows: list[Row]) -> None:
        """Where this phase's values go (a replay stages them: see ReplayRun)."""
        self.db.append_logs(self.run_id, self.phase, rows)

    def _flush_buffers(self) -> None:
        """Stage what is buffered as pending writes (RecordRun adds its batch fingerprints)."""
        self.logs.stage()

    def flush_logs(self) -> None:
        """Everything logged so far is in the database when this returns."""
        self._flush_buffers()
        self.logs.flush()

    #: This process's rank in a multi-rank job (the context of ``rank="all"`` values).
    rank_index = 0

    def log(self, name: str, value: Any, every_rank: bool = False) -> None:
        self.values.log(self.pos.stack, name, value, every_rank, drop=self.pos.stale_start or self.past_plan)

    def log_at(self, ctx: list[tuple[str, int]], name: str, value: Any) -> None:
        """`value` at a context of loops a framework runs, not hs.loop
        (Lightning's epoch and global step: `hindsight.lightning`)."""
        self.values.log_at(ctx, name, value)

    def _gather_ranks_values(self) -> None:
        """Every rank: the values other ranks logged with ``rank="all"``,
        and what else a rank keeps for rank 0 (`_rank_extra`), go to rank
        0's buffers. Called where the ranks are together and before what
        they logged may be covered by a checkpoint (a save, an iteration's
        end), so a resume neither loses nor repeats them."""
        if self.ranks is None:
            return
        for extra in self.values.gather_ranks(self._rank_extra()):
            self._add_rank_extra(extra)

    def _rank_extra(self) -> list[Any]:
        """A following rank's rows for rank 0 beside its values (taken)."""
        return []

    def _add_rank_extra(self, rows: list[Any]) -> None:
        """Rank 0: another rank's `_rank_extra`."""

    def load_checkpoint(self, name: str, reshard: bool = False) -> dict[str, Any] | None:
        """Checkpoint ``name`` as this process continues from it: for a
        checkpoint of several ranks, the objects with this rank's own state.
        Another world size is refused (core's rule, `resume_fit`) unless
        ``reshard`` opts in: the objects are then cut to this job's ranks,
        a rank the checkpoint has continues its state, a new rank takes
        rank 0's without its RNG streams (it keeps those the script seeded);
        None for a checkpoint inside an iteration, which cannot reshard."""
        info = self.store.info(name)
        saved = info["meta"].get(_native.META_WORLD)
        size = 1 if self.ranks is None else self.ranks.size
        fit = _native.resume_fit(name, None if saved is None else int(saved), size, reshard)
        if fit == "skip":
            return None
        if saved is None and fit == "same":
            whole: dict[str, Any] = self.store.load(name)
            return whole
        from hindsight import dist

        # Where the live objects are sharded (FSDP2), each rank reads only
        # its own shards of them.
        entries = [e[0] for e in info["entries"]]
        if saved is None:  # one process's checkpoint, onto several ranks
            whole = dist.load_onto_live(self.store, name, [], self.objects, entries)
            shared: dict[str, Any] = {k: whole.pop(k) for k in ("objects", "grads") if k in whole}
            mine, own = whole, self.rank_index == 0
        else:
            own = self.rank_index < int(saved)
            src = self.rank_index if own else 0
            mine = self.store.load(name, path=[dist._RANK_STATE, str(src)])
            shared = dist.load_onto_live(self.store, name, [dist._STATE], self.objects, entries)
        if not own:
            for key in _RNG_KEYS:
                mine.pop(key, None)
        return {**mine, **shared}

    def arg(self, name: str, default: Any) -> Any:
        raise NotImplementedError

    def parse_args(self, parser: Any, argv: list[str] | None) -> Any:
        raise NotImplementedError

    def finish(self, status: str = "completed") -> None:
        """At exit (or on an uncaught exception): logs and checkpoints made durable."""
        if self.finished:
            return
        self.finished = True
        self._flush_buffers()
        self.logs.close()
        self._finish(status)

    def _finish(self, status: str) -> None:
        if self._store is not None:
            self._store.flush()

    # -- loops -------------------------------------------------------------------
    def loop(self, name: str, iterable: Iterable[T]) -> Iterator[T]:
        if not self.pos.stack:
            if self.pos.outer_name is not None and jupyter.shell() is not None:
                # A training cell run again in the same kernel: its loop would
                # overwrite this run's iterations, checkpoints and values.
                raise InvalidArgumentError(
                    f"hs.loop({name!r}): run {self.run_id} of {self.script.name} already ran its outer loop "
                    f"'{self.pos.outer_name}' in this kernel, and a second one would mix two trainings into one run; "
                    "restart the kernel and run the notebook again to record a new run"
                )
            return self._outer(name, iterable)
        if len(self.pos.stack) == 1 and not self.pos.block_done:
            gen = self._block(name, iterable)
            self.pos.block_gen = gen  # what an enumerate() around it iterates (see counters.py)
            return gen
        return self._plain(name, iterable)

    def _explain(self, name: str, frame: Any) -> None:
        """`hindsight record --explain`: say what each checkpoint will hold
        and why, then stop before the first iteration."""
        where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        print(f"loop '{name}' ({where}) is the outer loop: a checkpoint is taken after its inner loop")
        if not self.objects:
            print("  no objects: hs.checkpointing(...) is not active here, so nothing is checkpointed")
        for key, obj in self.objects.items():
            found = self.discovered.get(key)
            why = f"read by the loop at line {found[1]}" if found else "given to hs.checkpointing"
            print(f"  {key}: {type(obj).__module__}.{type(obj).__qualname__} ({why}), through its state_dict()")
        print("  random number generators: Python, NumPy, torch (and CUDA)")
        names = self.pos.outer_vars.names if self.pos.outer_vars is not None else {}
        scope = {**frame.f_globals, **frame.f_locals}
        ids = self._object_ids()
        # Imported modules and the objects above are not loop variables.
        names = {
            k: v
            for k, v in names.items()
            if not isinstance(scope.get(k), types.ModuleType) and id(scope.get(k)) not in ids
        }
        if names:
            print("  variables the loop changes, saved when storable (numbers, strings, tensors, arrays, containers):")
            for var, line in sorted(names.items(), key=lambda kv: abs(kv[1])):
                how = "calls a method on it" if line < 0 else "assigns it"
                print(f"    {var} (line {abs(line)}: {how})")
        print("  the inner loop's variables are found when it starts")
        sys.stdout.flush()
        raise SystemExit(0)

    def _plain(self, name: str, iterable: Iterable[T]) -> Iterator[T]:
        entry: list[Any] = [name, -1]
        self.pos.stack.append(entry)
        try:
            for i, x in enumerate(iterable):
                entry[1] = i
                self.heartbeat()
                yield x
        finally:
            self.pos.stack.remove(entry)

    def _outer(self, name: str, iterable: Iterable[T]) -> Iterator[T]:
        """The outermost loop: one iteration is the unit of checkpoints and replay."""
        # sys._getframe(1): the frame whose `for` drives this generator.
        frame = sys._getframe(1)
        self.pos.loop_started = True
        if self.hands_free and not self.objects:
            self.discovered = stateful_objects(frame)
            self.objects.update({k: v for k, (v, _) in self.discovered.items()})
        self.pos.outer_vars = LoopVars.of(frame, name, self._object_ids())
        self.module_vars.add(self.pos.outer_vars)
        if _settings.flag(ENV_EXPLAIN, False):
            self._explain(name, frame)
        entry: list[Any] = [name, -1]
        self.pos.stack.append(entry)
        self.pos.outer_name = name
        self._outer_starts(name, len(iterable) if isinstance(iterable, Sized) else None)
        try:
            for i, x in enumerate(iterable):
                visit = self._visit(i)
                if visit.kind == _native.VisitKind.STOP:
                    break
                if visit.kind == _native.VisitKind.SKIP:
                    continue
                entry[1] = i
                self.pos.outer_idx = i
                # The value iterated over, beside the position, when it is an
                # integer (epoch 1 of range(1, N)): what --where and the
                # dataframe show.
                self.pos.outer_value = x if isinstance(x, numbers.Integral) and not isinstance(x, bool) else None
                self.heartbeat()
                self.pos.iter_start = time.perf_counter()
                self.pos.block_done = False
                self.values.outer_iteration_starts()
                self.pos.stale_start = visit.stale
                self._iteration_starts(i)
                try:
                    yield x
                except GeneratorExit:
                    # A `break` ends the loop in this iteration (or an
                    # exception unwinds it): the iteration ran, so it is
                    # recorded and can be replayed.
                    if not self.finished:
                        self._end_iteration(i, closing=True)
                    raise
                self.pos.stale_start = False
                self._iteration_continues()
                if not self.pos.block_done:
                    self._end_block(i, at="iteration")
                self._end_iteration(i)
            else:
                self._outer_ends()
        finally:
            self.pos.stack.remove(entry)
            self.flush_logs()

    def _block(self, name: str, iterable: Iterable[T]) -> Iterator[T]:
        """The first loop nested in the outer loop: the skippable training steps."""
        i = self.pos.outer_idx
        self.pos.stale_start = False  # restored or rebuilt below
        if not self.pos.iter_kept:
            self._start_unkept(i)
        self.pos.blocks_seen = True
        self.pos.block_vars = LoopVars.of(sys._getframe(1), name, self._object_ids())
        self.module_vars.add(self.pos.block_vars)
        self.pos.block_live = True
        steps = self._block_starts(i, iterable)
        if steps is None:  # restored: the steps do not run
            self.pos.block_done = True
            self.pos.block_live = False
            return
        entry: list[Any] = [name, -1]
        self.pos.stack.append(entry)
        ok = closed = False
        try:
            it, start = steps
            gen, self.pos.block_gen = self.pos.block_gen, None
            if start:
                shift_enumerates(gen, start, f"{self.pos.outer_name} {i}, step {start}")
            del gen
            # The steps' per-step work is native (`_native.StepLoop`): no
            # frame of ours runs between two steps on the common path.
            loop = self._step_loop(i, it, start, entry)
            try:
                yield from loop
            finally:
                loop.close()
            ok = True
        except GeneratorExit:
            # Closed early: a `break` out of the steps (the block ended), or
            # an exception unwinding the loop (it did not), which Python does
            # not let us tell apart here. The checkpoint is written now and
            # kept unless the run then fails (see `_block_closed`); a run
            # already finished (torn down after a crash) writes none.
            closed = not self.finished
            raise
        finally:
            self.pos.stack.remove(entry)
            self._block_ends()
            if closed and self._closed_block_ends_later():
                closed = False  # `_outer` ends the iteration as a whole if it goes on
            if (ok or closed) and not self.pos.block_done:
                self._end_block(i)
                if closed:
                    self._block_closed(i)
            self.pos.block_live = False

    # Hooks of the loops, defined by RecordRun and ReplayRun: each turns a
    # loop event into its session's event (core `runs::session`) and carries
    # out the action it answers.
    def _outer_starts(self, name: str, length: int | None) -> None:
        pass

    def _outer_ends(self) -> None:
        """The outer loop ran out of iterations (no `break`)."""

    def _block_closed(self, i: int) -> None:
        """The steps of iteration i were left early (break or exception)."""

    def _closed_block_ends_later(self) -> bool:
        """Whether steps left early end their block only if the iteration
        then goes on normally (as one ending the whole iteration). Under
        several ranks they may be a `break` on every rank or an exception on
        one (a peer's closed connection): their block ends (collectives,
        checks) wait for the iteration to go on."""
        return self.ranks is not None

    def _iteration_starts(self, i: int) -> None:
        """Outer iteration i is about to run its body: its loop variables as
        they are now are part of a checkpoint taken inside it (a resume
        re-runs the code before the steps from them), where kept."""
        self.pos.iter_kept = self._keeps_start()
        self.pos.iterations_started += 1
        self.pos.iter_values = None
        if self.pos.iter_kept and self.objects and self.pos.outer_vars is not None:
            self.pos.iter_values = self.pos.outer_vars.snapshot()

    def _keeps_start(self) -> bool:
        """Whether to keep the state the iteration starts with. Only a
        checkpoint inside an iteration (within or after its steps, before
        its end) needs it, and only an iteration that runs steps has one: a
        loop of one-step iterations (minGPT's `while True`) would pay the
        copy, a tenth of a millisecond step, for nothing. Kept in the first
        iteration a process runs and in every one after an iteration ran
        steps; an iteration that runs steps without it takes no checkpoint
        inside (`_start_unkept`)."""
        return self.pos.iterations_started == 0 or self.pos.blocks_seen

    def _start_unkept(self, i: int) -> None:
        """Iteration i runs steps, and its start was not kept."""

    def _iteration_continues(self) -> None:
        """The body of the current outer iteration went on normally after the steps."""

    def _visit(self, i: int) -> Any:
        """What to do with outer iteration i: the session's `Visit` (its
        `kind` says run, skip or stop; `stale`: see `stale_start`)."""
        raise NotImplementedError

    def _block_starts(self, i: int, iterable: Iterable[T]) -> tuple[Iterator[T], int] | None:
        """The steps of iteration i, as (iterator, first step); None when
        they are not run (their state came from a checkpoint)."""
        return iter(iterable), 0

    def _step_loop(self, i: int, it: Iterator[Any], start: int, entry: list[Any]) -> _native.StepLoop:
        """The steps of iteration i from `start`: what starts and ends each
        (`_native.StepLoop`, told by `_new_step_loop`)."""
        raise NotImplementedError

    def _new_step_loop(self, i: int, it: Iterator[Any], start: int, entry: list[Any], **how: Any) -> _native.StepLoop:
        return _native.StepLoop(
            it,
            i=i,
            start=start,
            entry=entry,
            reps=self.values.reps_inner,
            run=self,
            printer=batches.printer,
            beat_fd=self._beat_fd,
            **how,
        )

    def _block_ends(self) -> None:
        pass

    def _end_block(self, i: int, at: str = "block") -> None:
        self.pos.block_done = True

    def _end_iteration(self, i: int, closing: bool = False) -> None:
        """After outer iteration i; ``closing``: the loop ends inside it (`break`)."""
        self.flush_logs()

    # -- state -------------------------------------------------------------------
    def capture(self) -> dict[str, Any]:
        state = capture(self.objects, [(e[0], e[1]) for e in self.pos.stack])
        block = self.pos.block_vars if self.pos.block_live else None
        shared = _storages(state["objects"])
        loop_vars: dict[str, Any] = {}
        if self.pos.outer_vars is not None:
            loop_vars["outer"] = self.pos.outer_vars.capture(self.pos.outer_vars.without(block), shared, self.transient)
        if block is not None:
            loop_vars["block"] = block.capture(block.names, shared, self.transient)
        if self.pos.iter_values is not None and self.pos.outer_vars is not None:
            # As they were when the iteration began: a resume re-runs the
            # code before the steps from them (RecordRun._visit).
            loop_vars["iter"] = self.pos.outer_vars.capture(
                self.pos.outer_vars.names, shared, self.transient, at=self.pos.iter_values
            )
        for lv in (self.pos.outer_vars, block):
            if lv is not None:
                self.unkept.update(lv.unkept)
        loop_vars["modules"] = self.module_vars.capture(self._object_ids(), shared)
        state["vars"] = loop_vars
        kept = self.files.capture() if self.files is not None else {}
        if kept:
            state["files"] = {"paths": list(kept), "data": list(kept.values())}
        return state

    def _object_ids(self) -> set[int]:
        return {id(o) for o in self.objects.values()}

    def _apply_vars(self, state: dict[str, Any]) -> None:
        """Put the loops' variables back into the frames running them."""
        saved = state.get("vars") or {}
        if "modules" in saved:
            self.module_vars.restore(saved["modules"])
        if self.pos.outer_vars is not None and "outer" in saved:
            self.pos.outer_vars.restore(saved["outer"])
        if self.pos.block_live and self.pos.block_vars is not None and "block" in saved:
            self.pos.block_vars.restore(saved["block"])

    def _apply_objects(self, state: dict[str, Any], name: str) -> None:
        apply_state(self.objects, state["objects"], name)

    def _apply(self, state: dict[str, Any], name: str, rng: bool = True) -> None:
        """Everything a checkpoint holds back into the program; ``rng``:
        the RNG states too (a resume inside the steps sets them itself)."""
        self._apply_objects(state, name)
        if "grads" in state:
            apply_grads(self.objects, state["grads"], name)
        self._apply_vars(state)
        if "files" in state:
            put_back(files_of(state["files"], name), Path.cwd(), name, protected=[self.script, self.home])
        if rng and "rng" in state:  # a new rank of a resharded resume keeps its own
            set_rng_state(state["rng"])

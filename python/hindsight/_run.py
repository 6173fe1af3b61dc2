"""Recording and replaying a training run: hs.arg, hs.loop, hs.log,
hs.checkpointing. One run per process, created at the first call.

Record (a plain `python train.py`): arguments, source, logs and, at the end
of the first `hs.loop` nested in the outer loop (the training steps) of each
outer iteration, a checkpoint of the objects given to `hs.checkpointing`
plus the RNG states, when the adaptive policy says it is worth it.

Replay (a worker started by `hindsight replay`, env HINDSIGHT_REPLAY): the
outer loop visits only the iterations of this worker's plan. In "restore"
iterations the inner loop yields nothing and the state is restored from that
iteration's checkpoint instead, so the code after it (and any new `hs.log`
there) runs on exactly the recorded state; in "execute" iterations it runs.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import platform
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from hindsight import _native, _preemption
from hindsight.errors import HindsightError, InvalidArgumentError, ReplayError

T = TypeVar("T")

ENV_HOME = "HINDSIGHT_HOME"
ENV_REPLAY = "HINDSIGHT_REPLAY"
ENV_EPSILON = "HINDSIGHT_EPSILON"
ENV_EVERY = "HINDSIGHT_CHECKPOINT_EVERY"
ENV_RUN_NAME = "HINDSIGHT_RUN_NAME"
ENV_RESUME = "HINDSIGHT_RESUME"
ENV_STORE = "HINDSIGHT_STORE"
ENV_LOCAL_FIRST = "HINDSIGHT_LOCAL_FIRST"
_INF = float("inf")


def _package_version() -> str:
    try:
        from importlib.metadata import version

        return version("hindsight")
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


def _normalize_store(location: str | os.PathLike[str], what: str) -> str:
    """`s3://bucket/prefix` as given (no trailing slash); a directory made absolute."""
    text = os.fspath(location)
    if not isinstance(text, str) or not text:
        raise InvalidArgumentError(f"{what}: empty store location")
    if text.startswith("s3://"):
        if len(text.rstrip("/")) <= len("s3://"):
            raise InvalidArgumentError(f"{what}={text!r}: give s3://bucket or s3://bucket/prefix")
        return text.rstrip("/")
    if "://" in text:
        raise InvalidArgumentError(f"{what}={text!r}: only local directories and s3:// URLs are supported")
    return str(Path(text).expanduser().absolute())


def _env_float(name: str, scale: float) -> float | None:
    v = os.environ.get(name)
    return float(v) * scale if v else None


def _advance(it: Iterator[Any], n: int) -> None:
    """Skip n items. For a single-process DataLoader, skip indices without loading the samples."""
    sampler_iter = getattr(it, "_sampler_iter", None)
    if sampler_iter is not None and getattr(it, "_num_workers", 1) == 0 and hasattr(it, "_num_yielded"):
        for _ in range(n):
            next(sampler_iter)
        it._num_yielded += n
        return
    for _ in range(n):
        next(it)


LOG_BATCH = 1024
MAX_LOGGED_ELEMENTS = 10_000
_SKIP_DIRS = {".git", ".hindsight", "__pycache__", "node_modules", "site-packages", ".venv", "venv", "build", "target"}


def _script_path() -> Path:
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 and argv0 not in ("-c", "-m") and Path(argv0).exists():
        return Path(argv0).resolve()
    return Path.cwd().resolve() / "<interactive>"


def _snapshot_source(root: Path, script: Path) -> dict[str, str]:
    """The project's Python files as they are now (content-addressed by the db)."""
    files: dict[str, str] = {}
    budget = 20 << 20
    candidates = [script] if script.exists() else []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d
            for d in dirnames
            if d not in _SKIP_DIRS and not d.startswith(".") and not (Path(dirpath) / d / "pyvenv.cfg").exists()
        ]
        candidates += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
        if len(candidates) > 2000:
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


def _to_json(value: Any, name: str, what: str = "hs.log") -> Any:
    """``value`` as plain JSON types (numpy and torch scalars become numbers);
    refuses what cannot be recorded, naming ``what(name)``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() > MAX_LOGGED_ELEMENTS:
            raise InvalidArgumentError(
                f"{what}({name!r}): tensor of {value.numel()} elements is too large to log "
                f"(at most {MAX_LOGGED_ELEMENTS}); log a summary such as .norm()"
            )
        return value.detach().cpu().tolist()
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(value, np.ndarray):
            if value.size > MAX_LOGGED_ELEMENTS:
                raise InvalidArgumentError(f"{what}({name!r}): array of {value.size} elements is too large to log")
            return value.tolist()
        if isinstance(value, np.generic):
            return value.item()
    if isinstance(value, (list, tuple)):
        return [_to_json(v, name, what) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v, name, what) for k, v in value.items()}
    raise InvalidArgumentError(
        f"{what}({name!r}): cannot record a value of type {type(value).__qualname__}; "
        "use numbers, strings, bools, or small tensors/arrays"
    )


def _parse_override(name: str, default: Any) -> tuple[bool, Any]:
    """`--name value` or `--name=value` on the command line, converted to the default's type."""
    argv = sys.argv[1:]
    flag = f"--{name}"
    raw = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            raw = argv[i + 1]
        elif a.startswith(flag + "="):
            raw = a[len(flag) + 1 :]
    if raw is None:
        return False, default
    try:
        if isinstance(default, bool):
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return True, raw.lower() in ("1", "true", "yes")
        if isinstance(default, int):
            return True, int(raw)
        if isinstance(default, float):
            return True, float(raw)
        if isinstance(default, str):
            return True, raw
        return True, json.loads(raw)
    except ValueError as e:
        raise InvalidArgumentError(f"argument --{name}: cannot read {raw!r} as {type(default).__name__}") from e


class Run:
    """The process's run. Created by the first hs.* call."""

    def __init__(self) -> None:
        self.script = _script_path()
        self.paths = _native.project_paths(str(self.script.parent))
        self.home = Path(self.paths.home)
        self.root = self.home.parent
        self.db = _native.LogDb(str(self.paths.db))  # creates the home durably if needed
        self._store: Any = None
        # Where checkpoints go: hs.checkpointing(store=, local_first=), else
        # $HINDSIGHT_STORE / $HINDSIGHT_LOCAL_FIRST, else <home>/store. Read at
        # the first store access, so hs.checkpointing may come after hs.arg.
        self.store_location: str | None = None
        self.local_first: str | None = None
        self.recorded_store: str | None = None
        self.resume_pending = False
        self.args: dict[str, Any] = {}
        self.buffer: list[tuple[str, list[tuple[str, int]], str]] = []
        self.log_queue: queue.Queue[Any] = queue.Queue()
        self.log_error: BaseException | None = None
        self.log_thread: threading.Thread | None = threading.Thread(
            target=self._log_writer, name="hindsight-logs", daemon=True
        )
        self.log_thread.start()
        self.stack: list[list[Any]] = []  # [loop name, index]
        self.objects: dict[str, Any] = {}
        self.outer_name: str | None = None
        self.outer_idx = -1
        self.iter_start = 0.0
        self.block_done = False
        self.iter_checkpoint: str | None = None
        self.iter_materialize: float | None = None
        self.last_blocked: float | None = None
        self.inner_steps_executed = 0
        self.blocks_restored = 0
        self.finished = False
        # Preemption: set by signal handlers, acted on at the next step boundary.
        self.stop_signal: int | None = None
        self.exit_code: int | None = None
        self.requeue = _preemption.requeue_default()
        self.safety_seconds: float | None = _env_float("HINDSIGHT_SAFETY_MINUTES", 60.0)
        self.last_checkpoint_time = time.monotonic()
        self.retention: dict[str, Any] = {}
        self.resume: dict[str, Any] | None = None
        self.block_rng: dict[str, Any] | None = None
        self.block_iterable: Any = None
        eps = float(os.environ.get(ENV_EPSILON, 1.0 / 15.0))
        self.policy = _native.AdaptivePolicy(eps)
        every = os.environ.get(ENV_EVERY)
        self.every: int | None = int(every) if every else None
        plan_path = os.environ.get(ENV_REPLAY)
        self.plan: Any = None
        if plan_path:
            self.mode = "replay"
            with open(plan_path) as f:
                self.plan = _native.WorkerPlan.from_json(f.read())
            self.run_id = self.plan.run_id
            row = self.db.run(self.run_id)
            self.recorded_store = row.get("store")
            self.args = json.loads(row["args_json"] or "{}")
            self.modes = self.plan.modes
            self.checkpoints = self.plan.checkpoints
            self.progress = self.plan.progress_fd
        else:
            self.mode = "record"
            self._start_record()
        atexit.register(self.finish)

    def _start_record(self) -> None:
        explicit = os.environ.get(ENV_RUN_NAME)
        key = explicit or hashlib.sha256(json.dumps([str(self.script), sys.argv[1:]]).encode()).hexdigest()[:32]
        prev = None
        if os.environ.get(ENV_RESUME, "1") != "0":
            prev = self.db.run_to_resume(key, explicit is not None)
        if prev is not None:
            self.run_id = prev["id"]
            self.args = json.loads(prev["args_json"] or "{}")
            self.db.set_status(self.run_id, "running", False)
            self.recorded_store = prev.get("store")
            # The checkpoint is looked up when the outer loop starts: by then
            # hs.checkpointing has said where the store is.
            self.resume_pending = True
            print(f"hindsight: resuming run {self.run_id}", file=sys.stderr, flush=True)
        else:
            files = _snapshot_source(self.root, self.script)
            source_hash = self.db.put_source(files)
            commit, dirty = _git(self.root)
            versions = {
                "python": platform.python_version(),
                "hindsight": _package_version(),
                "argv": sys.argv[:],
                "cwd": os.getcwd(),
                "executable": sys.executable,
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            }
            for mod in ("torch", "numpy"):
                m = sys.modules.get(mod)
                if m is not None:
                    versions[mod] = getattr(m, "__version__", "?")
            try:
                script_rel = str(self.script.relative_to(self.root))
            except ValueError:
                script_rel = str(self.script)
            self.run_id = self.db.create_run(
                script_rel,
                str(self.script),
                str(self.root),
                source_hash,
                "{}",
                socket.gethostname(),
                json.dumps(versions),
                commit,
                dirty,
                key,
            )
        self._wrap_excepthook()
        self._install_signals()

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        sigs = _preemption.signals(os.environ.get("HINDSIGHT_CATCH_SIGINT") == "1")

        def handler(signum: int, frame: Any) -> None:
            # Only a flag: the checkpoint is written on the training thread at
            # the next step boundary, never inside the handler.
            if self.stop_signal is None:
                self.stop_signal = signum

        for sig in sigs:
            signal.signal(sig, handler)

    def _latest_checkpoint(self) -> dict[str, Any] | None:
        """The newest complete checkpoint of this run (listed = complete)."""
        for ck in reversed(self.store.checkpoints(self.run_id)):
            try:
                state = self.store.load(ck.name)
            except Exception as e:  # noqa: BLE001 - try the previous one, say why
                print(f"hindsight: cannot resume from {ck.name}: {e}", file=sys.stderr)
                continue
            kind = ck.kind
            if kind == "block" and state.get("at") == "iteration":
                kind = "end"  # taken at the end of an outer iteration without an inner hs.loop
            return {"name": ck.name, "kind": kind, "epoch": ck.index, "step": ck.step or 0, "state": state}
        return None

    def _checkpoint_id(self, i: int, kind: str = "block", step: int | None = None) -> _native.CheckpointId:
        return _native.CheckpointId(self.run_id, self.outer_name or "loop", i, kind, step)

    def _save_now(self, ck: _native.CheckpointId, extra: dict[str, Any], wait: bool) -> None:
        state = self.capture()
        state.update(extra)
        t0 = time.perf_counter()
        h = self.store.save(ck.name, state, meta={**ck.meta(), "run": self.run_id})
        self.last_blocked = time.perf_counter() - t0
        self.last_checkpoint_time = time.monotonic()
        if wait:
            h.wait()
            self.store.flush()

    def _step_boundary(self, i: int, j: int) -> None:
        """Between two training steps: act on a signal or a due safety checkpoint."""
        if self.mode != "record" or not self.objects:
            if self.stop_signal is not None and self.mode == "record":
                self._exit_for_signal()
            return
        mid = {"block_rng": self.block_rng, "position": [i, j]}
        loader = self.block_iterable
        if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict") and not hasattr(loader, "parameters"):
            mid["loader_state"] = loader.state_dict()
        if self.stop_signal is not None:
            self.flush_logs()
            self._save_now(self._checkpoint_id(i, "step", j), mid, wait=True)
            self._exit_for_signal()
        if self.safety_seconds is not None and time.monotonic() - self.last_checkpoint_time > self.safety_seconds:
            self.flush_logs()
            self._save_now(self._checkpoint_id(i, "step", j), mid, wait=False)

    def _iteration_boundary(self, i: int) -> None:
        """After outer iteration i: act on a signal (the next iteration starts afresh on resume)."""
        if self.stop_signal is None or self.mode != "record":
            return
        self.flush_logs()
        if self.objects:
            self._save_now(self._checkpoint_id(i, "end"), {}, wait=True)
        self._exit_for_signal()

    def _exit_for_signal(self) -> None:
        sig = self.stop_signal
        self.flush_logs()
        if self._store is not None:
            self._store.flush()
        self.db.set_status(self.run_id, "interrupted")
        self.finished = True
        _preemption.leave(sig, f"run {self.run_id}", self.exit_code, requeue=self.requeue)

    def apply_retention(self, final: bool = False) -> None:
        if self.mode != "record" or not self.retention or self._store is None:
            return
        metric = self.retention.get("best_metric")
        values: dict[int, float] = {}
        if metric:
            self.flush_logs()
            for _name, ctx, value, _phase, _seq in self.db.logs(self.run_id, [metric]):
                if len(ctx) == 1:
                    try:
                        values[ctx[0][1]] = float(json.loads(value))
                    except (TypeError, ValueError):
                        pass
        self.store.apply_retention(
            self.run_id,
            keep_last=self.retention.get("keep_last"),
            keep_best=self.retention.get("keep_best"),
            best_mode=self.retention.get("best_mode", "min"),
            keep_every=self.retention.get("keep_every"),
            metrics=values if metric else None,
        )
        if final:
            self.store.gc()

    # -- plumbing ------------------------------------------------------------
    def _find_resume(self) -> None:
        if not self.resume_pending:
            return
        self.resume_pending = False
        self.resume = self._latest_checkpoint()
        where = "the start" if self.resume is None else f"checkpoint {self.resume['name']}"
        print(
            f"hindsight: run {self.run_id} continues from {where} (store {self.store.path})",
            file=sys.stderr,
            flush=True,
        )

    def set_store(self, location: str | os.PathLike[str] | None, local_first: str | os.PathLike[str] | None) -> None:
        """hs.checkpointing(store=..., local_first=...): only before the store is first used."""
        loc = None if location is None else _normalize_store(location, "store")
        local = None if local_first is None else _normalize_store(local_first, "local_first")
        if local is not None and local.startswith("s3://"):
            raise InvalidArgumentError(f"hs.checkpointing(local_first={local_first!r}): must be a local directory")
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

    @property
    def store(self) -> Any:
        if self._store is None:
            from hindsight._store import Store

            default = str(self.paths.store)
            env = os.environ.get(ENV_STORE) or None
            configured = self.store_location or (None if env is None else _normalize_store(env, ENV_STORE))
            if self.mode == "replay" or self.recorded_store:
                # Replay and resume read where the run wrote.
                location = self.recorded_store or default
                if configured is not None and configured != location and self.mode == "record":
                    print(
                        f"hindsight: resuming in the run's store {location} (not {configured})",
                        file=sys.stderr,
                        flush=True,
                    )
            else:
                location = configured or default
            local = self.local_first
            if local is None and os.environ.get(ENV_LOCAL_FIRST):
                local = _normalize_store(os.environ[ENV_LOCAL_FIRST], ENV_LOCAL_FIRST)
            if self.mode == "replay" or local == location:
                local = None
            self._store = Store(location, local_first=local)
            self.store_location, self.local_first = location, local
            if self.mode == "record" and self.recorded_store != location:
                self.db.set_store(self.run_id, location)
                self.recorded_store = location
        return self._store

    @property
    def phase(self) -> str:
        return "replay" if self.mode == "replay" else "record"

    def _wrap_excepthook(self) -> None:
        previous = sys.excepthook

        def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
            self.finish("interrupted" if issubclass(tp, KeyboardInterrupt) else "failed")
            previous(tp, value, tb)

        sys.excepthook = hook

    def _log_writer(self) -> None:
        """Background thread: full batches go to SQLite off the training thread
        (the database call releases the GIL)."""
        while True:
            rows = self.log_queue.get()
            try:
                if rows is None:
                    return
                if self.log_error is None:
                    self.db.append_logs(self.run_id, self.phase, rows)
            except BaseException as e:  # noqa: BLE001 - surfaced by the next log/flush
                self.log_error = e
            finally:
                self.log_queue.task_done()

    def _raise_log_error(self) -> None:
        if self.log_error is not None:
            e, self.log_error = self.log_error, None
            raise e

    def _submit(self, rows: list[tuple[str, list[tuple[str, int]], str]]) -> None:
        if self.log_thread is not None and self.log_thread.is_alive():
            self.log_queue.put(rows)
        else:  # after finish (or in a process without the thread): write directly
            self.db.append_logs(self.run_id, self.phase, rows)

    def flush_logs(self) -> None:
        """Everything logged so far is in the database when this returns."""
        if self.buffer:
            rows, self.buffer = self.buffer, []
            self._submit(rows)
        if self.log_thread is not None and self.log_thread.is_alive():
            self.log_queue.join()
        self._raise_log_error()

    def finish(self, status: str = "completed") -> None:
        if self.finished:
            return
        self.finished = True
        self.flush_logs()
        self.log_queue.put(None)
        if self.mode == "replay" and self.progress is not None:
            try:
                os.write(self.progress, f"steps {self.inner_steps_executed} restored {self.blocks_restored}\n".encode())
            except OSError:
                pass
        if self._store is not None:
            self._store.flush()
            if status == "completed":
                self.apply_retention(final=True)
        if self.mode == "record":
            self.db.set_status(self.run_id, status)

    # -- hs.arg / hs.log -------------------------------------------------------
    def arg(self, name: str, default: Any) -> Any:
        if self.mode == "replay":
            return self.args.get(name, default)
        _, value = _parse_override(name, default)
        # Recorded as plain JSON (a numpy scalar as a number; NaN and
        # infinities as Python's json writes them, which the engine accepts).
        self.args[name] = _to_json(value, name, "hs.arg")
        self.db.set_args(self.run_id, json.dumps(self.args))
        return value

    def log(self, name: str, value: Any) -> None:
        ctx = [(e[0], e[1]) for e in self.stack]
        t = type(value)
        if t is float and value == value and value not in (_INF, -_INF):
            text = repr(value)  # the JSON of a finite float, without the encoder's overhead
        elif t is int or t is bool:
            text = "true" if value is True else "false" if value is False else str(value)
        else:
            text = json.dumps(_to_json(value, name))
        self.buffer.append((name, ctx, text))
        if len(self.buffer) >= LOG_BATCH:
            self._raise_log_error()
            rows, self.buffer = self.buffer, []
            self._submit(rows)

    # -- loops -------------------------------------------------------------------
    def loop(self, name: str, iterable: Iterable[T]) -> Iterator[T]:
        if not self.stack:
            return self._outer(name, iterable)
        if len(self.stack) == 1 and not self.block_done:
            return self._block(name, iterable)
        return self._plain(name, iterable)

    def _plain(self, name: str, iterable: Iterable[T]) -> Iterator[T]:
        entry: list[Any] = [name, -1]
        self.stack.append(entry)
        try:
            for i, x in enumerate(iterable):
                entry[1] = i
                yield x
        finally:
            self.stack.remove(entry)

    def _outer(self, name: str, iterable: Iterable[T]) -> Iterator[T]:
        entry: list[Any] = [name, -1]
        self.stack.append(entry)
        self.outer_name = name
        last_needed = max(self.modes, default=-1) if self.mode == "replay" else None
        if self.mode == "record":
            self._find_resume()
        resume = self.resume
        try:
            for i, x in enumerate(iterable):
                if self.mode == "replay":
                    assert last_needed is not None
                    if i > last_needed:
                        break
                    if self.modes.get(i, "skip") == "skip":
                        continue
                if resume is not None:
                    first = resume["epoch"] + 1 if resume["kind"] == "end" else resume["epoch"]
                    if i < first:
                        continue  # done before the interruption; its state is in the checkpoint
                    if resume["kind"] == "end":
                        self._apply(resume["state"], resume["name"])
                        resume = self.resume = None
                entry[1] = i
                self.outer_idx = i
                self.iter_start = time.perf_counter()
                self.block_done = False
                self.iter_checkpoint = None
                self.iter_materialize = None
                yield x
                if not self.block_done:
                    self._end_block(i, at="iteration")
                self._end_iteration(i)
                resume = self.resume
                self._iteration_boundary(i)
        finally:
            self.stack.remove(entry)
            self.flush_logs()

    def _block(self, name: str, iterable: Iterable[T]) -> Iterator[T]:
        """The first loop nested in the outer loop: the skippable training steps."""
        i = self.outer_idx
        if self.mode == "replay" and self.modes.get(i) == "restore":
            self.block_done = True
            self._restore(i)
            return
        resume = self.resume
        if resume is not None and resume["epoch"] == i and resume["kind"] == "block":
            # Interrupted after this block's checkpoint: restore it, skip the steps.
            self.resume = None
            self.block_done = True
            self._apply(resume["state"], resume["name"])
            return
        entry: list[Any] = [name, -1]
        self.stack.append(entry)
        ok = False
        start = 0
        self.block_iterable = iterable
        try:
            if resume is not None and resume["epoch"] == i and resume["kind"] == "step":
                self.resume = None
                it, start = self._resume_steps(iterable, resume)
            else:
                self.block_rng = _preemption.rng_state()  # before iter(): a DataLoader draws its order here
                it = iter(iterable)
            for j, x in enumerate(it, start):
                entry[1] = j
                if self.mode == "replay":
                    self.inner_steps_executed += 1
                yield x
                self._step_boundary(i, j)
            ok = True
        except GeneratorExit:
            ok = True  # `break` out of the steps: the block still ended
            raise
        finally:
            self.stack.remove(entry)
            self.block_iterable = None
            if ok and not self.block_done:
                self._end_block(i)

    def _resume_steps(self, iterable: Any, resume: dict[str, Any]) -> tuple[Iterator[Any], int]:
        """Continue an interrupted block exactly: same data order, no sample repeated or skipped."""
        state = resume["state"]
        self._apply_objects(state, resume["name"])
        done = int(state["position"][1]) + 1
        if "loader_state" in state and hasattr(iterable, "load_state_dict"):
            iterable.load_state_dict(state["loader_state"])  # a stateful loader knows its own position
            self.block_rng = state["block_rng"]
            it = iter(iterable)
        else:
            # Re-create the epoch's order from the RNG state it was drawn from,
            # then step over what was consumed before the interruption.
            _preemption.set_rng_state(state["block_rng"])
            self.block_rng = state["block_rng"]
            it = iter(iterable)
            _advance(it, done)
        _preemption.set_rng_state(state["rng"])
        return it, done

    # -- checkpoints -------------------------------------------------------------
    def _end_block(self, i: int, at: str = "block") -> None:
        self.block_done = True
        if self.mode != "record" or not self.objects:
            return
        compute = time.perf_counter() - self.iter_start
        expected = self.last_blocked if self.last_blocked is not None else self._estimate_materialize()
        if self.every is not None:
            if i % self.every != 0:
                return
        elif not self.policy.observe_iteration(compute, expected):
            return
        ck = self._checkpoint_id(i)
        self._save_now(ck, {"at": at}, wait=False)
        self.policy.observe_materialize(self.last_blocked or 0.0)
        self.iter_checkpoint = ck.name
        self.iter_materialize = self.last_blocked

    def _estimate_materialize(self) -> float:
        nbytes = 0
        for obj in self.objects.values():
            sd = obj.state_dict() if hasattr(obj, "state_dict") else {"t": obj}
            nbytes += _tensor_bytes(sd)
        return nbytes / 2e9  # a first guess: a memory copy; refined by the first save

    def _end_iteration(self, i: int) -> None:
        if self.mode == "record":
            self.db.record_iteration(
                self.run_id,
                self.outer_name or "",
                i,
                time.perf_counter() - self.iter_start,
                self.iter_checkpoint,
                self.iter_materialize,
            )
            if self.retention and self.iter_checkpoint is not None:
                self.flush_logs()
                self.apply_retention()
        elif self.progress is not None:
            try:
                os.write(self.progress, f"{i}\n".encode())
            except OSError:
                self.progress = None
        self.flush_logs()

    def capture(self) -> dict[str, Any]:
        objs: dict[str, Any] = {}
        for key, obj in self.objects.items():
            objs[key] = obj.state_dict() if hasattr(obj, "state_dict") else obj
        return {"objects": objs, "rng": _preemption.rng_state(), "loop": [(e[0], e[1]) for e in self.stack]}

    def _apply_objects(self, state: dict[str, Any], name: str) -> None:
        apply_state(self.objects, state["objects"], name)

    def _apply(self, state: dict[str, Any], name: str) -> None:
        self._apply_objects(state, name)
        _preemption.set_rng_state(state["rng"])

    def _restore(self, i: int) -> None:
        name = self.checkpoints.get(i)
        if name is None:
            raise ReplayError(f"replay plan has no checkpoint for {self.outer_name} {i}")
        t0 = time.perf_counter()
        self._apply(self.store.load(name), name)
        self.blocks_restored += 1
        try:
            self.db.set_restore_seconds(self.run_id, self.outer_name or "", i, time.perf_counter() - t0)
        except HindsightError as e:  # bookkeeping only: say so, but never fail a replay for it
            print(f"hindsight: could not record the restore time of {name}: {e}", file=sys.stderr)


def _tensor_bytes(tree: Any) -> int:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tree, torch.Tensor):
        return int(tree.numel() * tree.element_size())
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def apply_state(objects: dict[str, Any], saved: dict[str, Any], checkpoint: str) -> None:
    """Put saved state back into the live objects given to hs.checkpointing."""
    missing = set(objects) - set(saved)
    if missing:
        raise ReplayError(
            f"checkpoint '{checkpoint}' has no state for {sorted(missing)}; "
            "hs.checkpointing(...) must name the same objects as when it was recorded"
        )
    import torch

    for key, obj in objects.items():
        if hasattr(obj, "load_state_dict"):
            obj.load_state_dict(saved[key])
            if isinstance(obj, torch.optim.Optimizer):
                # The restored optimizer has stepped (in the recorded run); tell
                # LR schedulers so they do not warn about step order.
                obj._opt_called = True  # type: ignore[attr-defined]
        elif isinstance(obj, torch.Tensor):
            with torch.no_grad():
                obj.copy_(saved[key])
        else:
            raise InvalidArgumentError(f"hs.checkpointing({key}=...): {type(obj).__qualname__} has no load_state_dict")


_RUN: Run | None = None


def current() -> Run:
    global _RUN
    if _RUN is None or _RUN.finished:
        _RUN = Run()
    return _RUN


def _after_fork() -> None:
    # A forked child (DataLoader worker) must not write into the parent's run.
    global _RUN
    if _RUN is not None:
        _RUN.finished = True
    _RUN = None


os.register_at_fork(after_in_child=_after_fork)


# -- public API -------------------------------------------------------------------
def arg(name: str, default: T) -> T:
    """A recorded hyper-parameter; `--name value` on the command line overrides the default.
    During replay it returns the recorded value."""
    value: T = current().arg(name, default)
    return value


def log(name: str, value: T) -> T:
    """Record `value` under `name` in the current loop context; returns `value`."""
    current().log(name, value)
    return value


def loop(name: str, iterable: Iterable[T]) -> Iterator[T]:
    """Iterate and record the loop context. The outermost `hs.loop` delimits
    checkpoints; the first `hs.loop` nested in it is the block replay can skip."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("hs.loop(name, iterable): name must be a non-empty string")
    return current().loop(name, iterable)


@contextmanager
def checkpointing(
    *,
    every: int | None = None,
    keep_last: int | None = None,
    keep_best: int | None = None,
    best_metric: str | None = None,
    best_mode: str = "min",
    keep_every: int | None = None,
    safety_minutes: float | None = None,
    exit_code: int | None = None,
    requeue: bool | None = None,
    store: str | os.PathLike[str] | None = None,
    local_first: str | os.PathLike[str] | None = None,
    **objects: Any,
) -> Iterator[None]:
    """Objects (modules, optimizers, schedulers, grad scalers, tensors) whose
    state is checkpointed at the end of each outer-loop iteration's training
    steps, restored during replay, and resumed after preemption.

    Period: adaptive by default (seed 001's Joint Invariant, epsilon 1/15 or
    $HINDSIGHT_EPSILON, so checkpointing costs at most epsilon of training
    time); ``every=N`` (or $HINDSIGHT_CHECKPOINT_EVERY) fixes it.

    Preemption: SIGTERM and SIGUSR1 (SIGINT with $HINDSIGHT_CATCH_SIGINT=1)
    make the loop checkpoint at the next step boundary, wait until durable,
    and exit with ``exit_code`` (default: HTCondor's CheckpointExitCode, else
    $HINDSIGHT_EXIT_CODE, else 85); ``requeue=True`` (or
    $HINDSIGHT_SLURM_REQUEUE=1) runs ``scontrol requeue $SLURM_JOB_ID`` first.
    ``safety_minutes`` (or $HINDSIGHT_SAFETY_MINUTES) adds a time-based
    checkpoint so a kill -9 loses at most that much work.

    Retention (a union; the newest checkpoint is always kept): ``keep_last=N``,
    ``keep_best=K`` by the epoch-level log ``best_metric`` (``best_mode`` "min"
    or "max"), ``keep_every=N`` epochs.

    Destination: ``store`` is a directory (local or a shared file system) or
    ``"s3://bucket/prefix"`` (AWS_* variables configure the endpoint and
    credentials); default $HINDSIGHT_STORE, else the project's
    ``.hindsight/store``. The run remembers it: replay and resume read there.
    ``local_first`` (or $HINDSIGHT_LOCAL_FIRST) is a local directory each
    checkpoint is committed to first and then uploaded from in the
    background; the exit on a signal waits for the upload.
    """
    if every is not None and every < 1:
        raise InvalidArgumentError(f"hs.checkpointing(every={every}): must be at least 1")
    if keep_best is not None and not best_metric:
        raise InvalidArgumentError("hs.checkpointing(keep_best=...) needs best_metric='<logged name>'")
    if best_mode not in ("min", "max"):
        raise InvalidArgumentError(f"hs.checkpointing(best_mode={best_mode!r}): use 'min' or 'max'")
    for key, obj in objects.items():
        torch = sys.modules.get("torch")
        if not hasattr(obj, "state_dict") and not (torch is not None and isinstance(obj, torch.Tensor)):
            raise InvalidArgumentError(
                f"hs.checkpointing({key}=...): {type(obj).__qualname__} has neither "
                "state_dict/load_state_dict nor is a tensor"
            )
    run = current()
    run.set_store(store, local_first)
    run.objects.update(objects)
    if every is not None:
        run.every = every
    if safety_minutes is not None:
        run.safety_seconds = safety_minutes * 60.0
    if exit_code is not None:
        run.exit_code = exit_code
    if requeue is not None:
        run.requeue = requeue
    policy = {
        "keep_last": keep_last,
        "keep_best": keep_best,
        "best_metric": best_metric,
        "best_mode": best_mode,
        "keep_every": keep_every,
    }
    if any(v is not None for k, v in policy.items() if k != "best_mode"):
        run.retention = policy
    try:
        yield
    finally:
        for key in objects:
            run.objects.pop(key, None)
        if run._store is not None:
            run._store.flush()


def run_id() -> str:
    return str(current().run_id)

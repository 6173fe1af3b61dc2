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
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from hindsight import _native
from hindsight.errors import InvalidArgumentError, ReplayError

T = TypeVar("T")

ENV_HOME = "HINDSIGHT_HOME"
ENV_REPLAY = "HINDSIGHT_REPLAY"
ENV_EPSILON = "HINDSIGHT_EPSILON"
ENV_EVERY = "HINDSIGHT_CHECKPOINT_EVERY"
LOG_BATCH = 1024
MAX_LOGGED_ELEMENTS = 10_000
_SKIP_DIRS = {".git", ".hindsight", "__pycache__", "node_modules", "site-packages", ".venv", "venv", "build", "target"}


def project_home(start: Path) -> Path:
    """$HINDSIGHT_HOME, else <git root of start>/.hindsight, else <start>/.hindsight."""
    env = os.environ.get(ENV_HOME)
    if env:
        return Path(env).resolve()
    start = start.resolve()
    for d in (start, *start.parents):
        if (d / ".git").exists():
            return d / ".hindsight"
    return start / ".hindsight"


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
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")
                       and not (Path(dirpath) / d / "pyvenv.cfg").exists()]
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
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    if commit.returncode != 0:
        return None, None
    return commit.stdout.strip(), bool(status.stdout.strip())


def _to_json(value: Any, name: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() > MAX_LOGGED_ELEMENTS:
            raise InvalidArgumentError(f"hs.log({name!r}): tensor of {value.numel()} elements is too large to log "
                                       f"(at most {MAX_LOGGED_ELEMENTS}); log a summary such as .norm()")
        return value.detach().cpu().tolist()
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(value, np.ndarray):
            if value.size > MAX_LOGGED_ELEMENTS:
                raise InvalidArgumentError(f"hs.log({name!r}): array of {value.size} elements is too large to log")
            return value.tolist()
        if isinstance(value, np.generic):
            return value.item()
    if isinstance(value, (list, tuple)):
        return [_to_json(v, name) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v, name) for k, v in value.items()}
    raise InvalidArgumentError(f"hs.log({name!r}): cannot log a value of type {type(value).__qualname__}; "
                               "log numbers, strings, bools, or small tensors/arrays")


def _parse_override(name: str, default: Any) -> tuple[bool, Any]:
    """`--name value` or `--name=value` on the command line, converted to the default's type."""
    argv = sys.argv[1:]
    flag = f"--{name}"
    raw = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            raw = argv[i + 1]
        elif a.startswith(flag + "="):
            raw = a[len(flag) + 1:]
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


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "torch" in state:
        import torch

        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class Run:
    """The process's run. Created by the first hs.* call."""

    def __init__(self) -> None:
        self.script = _script_path()
        self.home = project_home(self.script.parent)
        self.root = self.home.parent
        self.home.mkdir(parents=True, exist_ok=True)
        self.db = _native.LogDb(str(self.home / "logs.db"))
        self._store: Any = None
        self.args: dict[str, Any] = {}
        self.buffer: list[tuple[str, list[tuple[str, int]], str]] = []
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
        eps = float(os.environ.get(ENV_EPSILON, 1.0 / 15.0))
        self.policy = _native.AdaptivePolicy(eps)
        every = os.environ.get(ENV_EVERY)
        self.every: int | None = int(every) if every else None
        plan_path = os.environ.get(ENV_REPLAY)
        self.plan: dict[str, Any] | None = None
        if plan_path:
            self.mode = "replay"
            with open(plan_path) as f:
                self.plan = json.load(f)
            self.run_id = self.plan["run_id"]
            row = self.db.run(self.run_id)
            self.args = json.loads(row["args_json"] or "{}")
            self.modes = {int(k): v for k, v in self.plan["modes"].items()}
            self.checkpoints = {int(k): v for k, v in self.plan["checkpoints"].items()}
            self.progress = self.plan.get("progress_fd")
        else:
            self.mode = "record"
            files = _snapshot_source(self.root, self.script)
            source_hash = self.db.put_source(files)
            commit, dirty = _git(self.root)
            versions = {"python": platform.python_version(), "hindsight": _native.FORMAT_VERSION,
                        "argv": sys.argv[:], "cwd": os.getcwd(), "executable": sys.executable}
            for mod in ("torch", "numpy"):
                m = sys.modules.get(mod)
                if m is not None:
                    versions[mod] = getattr(m, "__version__", "?")
            key = hashlib.sha256(json.dumps([str(self.script), sys.argv[1:]]).encode()).hexdigest()[:32]
            try:
                script_rel = str(self.script.relative_to(self.root))
            except ValueError:
                script_rel = str(self.script)
            self.run_id = self.db.create_run(
                script_rel, str(self.script), str(self.root), source_hash, "{}", socket.gethostname(),
                json.dumps(versions), commit, dirty, key,
            )
            self._wrap_excepthook()
        atexit.register(self.finish)

    # -- plumbing ------------------------------------------------------------
    @property
    def store(self) -> Any:
        if self._store is None:
            from hindsight._store import Store

            self._store = Store(self.home / "store")
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

    def flush_logs(self) -> None:
        if self.buffer:
            rows, self.buffer = self.buffer, []
            self.db.append_logs(self.run_id, self.phase, rows)

    def finish(self, status: str = "completed") -> None:
        if self.finished:
            return
        self.finished = True
        self.flush_logs()
        if self.mode == "replay" and self.progress is not None:
            try:
                os.write(self.progress, f"steps {self.inner_steps_executed} restored {self.blocks_restored}\n".encode())
            except OSError:
                pass
        if self._store is not None:
            self._store.flush()
        if self.mode == "record":
            self.db.set_status(self.run_id, status)

    # -- hs.arg / hs.log -------------------------------------------------------
    def arg(self, name: str, default: Any) -> Any:
        if self.mode == "replay":
            return self.args.get(name, default)
        _, value = _parse_override(name, default)
        json.dumps(_to_json(value, name))  # refuse what cannot be recorded
        self.args[name] = value
        self.db.set_args(self.run_id, json.dumps(self.args))
        return value

    def log(self, name: str, value: Any) -> None:
        ctx = [(e[0], e[1]) for e in self.stack]
        self.buffer.append((name, ctx, json.dumps(_to_json(value, name))))
        if len(self.buffer) >= LOG_BATCH:
            self.flush_logs()

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
        try:
            for i, x in enumerate(iterable):
                if self.mode == "replay":
                    assert last_needed is not None
                    if i > last_needed:
                        break
                    if self.modes.get(i, "skip") == "skip":
                        continue
                entry[1] = i
                self.outer_idx = i
                self.iter_start = time.perf_counter()
                self.block_done = False
                self.iter_checkpoint = None
                self.iter_materialize = None
                yield x
                if not self.block_done:
                    self._end_block(i)
                self._end_iteration(i)
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
        entry: list[Any] = [name, -1]
        self.stack.append(entry)
        ok = False
        try:
            for j, x in enumerate(iterable):
                entry[1] = j
                if self.mode == "replay":
                    self.inner_steps_executed += 1
                yield x
            ok = True
        except GeneratorExit:
            ok = True  # `break` out of the steps: the block still ended
            raise
        finally:
            self.stack.remove(entry)
            if ok and not self.block_done:
                self._end_block(i)

    # -- checkpoints -------------------------------------------------------------
    def _end_block(self, i: int) -> None:
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
        name = f"{self.run_id}.{self.outer_name}-{i:06d}"
        t0 = time.perf_counter()
        self.store.save(name, self.capture(), meta={"run": self.run_id, "loop": self.outer_name or "", "index": i})
        blocked = time.perf_counter() - t0
        self.policy.observe_materialize(blocked)
        self.last_blocked = blocked
        self.iter_checkpoint = name
        self.iter_materialize = blocked

    def _estimate_materialize(self) -> float:
        nbytes = 0
        for obj in self.objects.values():
            sd = obj.state_dict() if hasattr(obj, "state_dict") else {"t": obj}
            nbytes += _tensor_bytes(sd)
        return nbytes / 2e9  # a first guess: a memory copy; refined by the first save

    def _end_iteration(self, i: int) -> None:
        if self.mode == "record":
            self.db.record_iteration(self.run_id, self.outer_name, i, time.perf_counter() - self.iter_start,
                                     self.iter_checkpoint, self.iter_materialize)
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
        return {"objects": objs, "rng": rng_state(), "loop": [(e[0], e[1]) for e in self.stack]}

    def _restore(self, i: int) -> None:
        name = self.checkpoints.get(i)
        if name is None:
            raise ReplayError(f"replay plan has no checkpoint for {self.outer_name} {i}")
        t0 = time.perf_counter()
        state = self.store.load(name)
        apply_state(self.objects, state["objects"], name)
        set_rng_state(state["rng"])
        self.blocks_restored += 1
        try:
            self.db.set_restore_seconds(self.run_id, self.outer_name or "", i, time.perf_counter() - t0)
        except Exception:  # noqa: BLE001 - bookkeeping only; never fail a replay for it
            pass


def _tensor_bytes(tree: Any) -> int:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def apply_state(objects: dict[str, Any], saved: dict[str, Any], checkpoint: str) -> None:
    """Put saved state back into the live objects given to hs.checkpointing."""
    missing = set(objects) - set(saved)
    if missing:
        raise ReplayError(f"checkpoint '{checkpoint}' has no state for {sorted(missing)}; "
                          "hs.checkpointing(...) must name the same objects as when it was recorded")
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
    return current().arg(name, default)


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
def checkpointing(*, every: int | None = None, **objects: Any) -> Iterator[None]:
    """Objects (modules, optimizers, schedulers, grad scalers, tensors) whose
    state is checkpointed at the end of each outer-loop iteration's training
    steps and restored during replay and resume.

    By default the period adapts (seed 001's Joint Invariant, epsilon 1/15 or
    $HINDSIGHT_EPSILON) so checkpointing costs at most epsilon of training
    time; ``every=N`` (or $HINDSIGHT_CHECKPOINT_EVERY) checkpoints every Nth
    outer iteration instead."""
    if every is not None and every < 1:
        raise InvalidArgumentError(f"hs.checkpointing(every={every}): must be at least 1")
    for key, obj in objects.items():
        torch = sys.modules.get("torch")
        if not hasattr(obj, "state_dict") and not (torch is not None and isinstance(obj, torch.Tensor)):
            raise InvalidArgumentError(f"hs.checkpointing({key}=...): {type(obj).__qualname__} has neither "
                                       "state_dict/load_state_dict nor is a tensor")
    run = current()
    run.objects.update(objects)
    if every is not None:
        run.every = every
    try:
        yield
    finally:
        for key in objects:
            run.objects.pop(key, None)
        if run._store is not None:
            run._store.flush()


def run_id() -> str:
    return current().run_id

"""Recording (a plain `python train.py`): arguments, source, logs and, at the
end of the first `hs.loop` nested in the outer loop (the training steps) of
each outer iteration, a checkpoint of the objects given to `hs.checkpointing`
plus the RNG states, when the adaptive policy says it is worth it. Also
preemption (checkpoint at the next step boundary, then exit) and resume."""

from __future__ import annotations

import atexit
import functools
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from hindsight import _native, _preemption, _settings
from hindsight._run import batches, cmdline, dataiter
from hindsight._run.common import (
    ENV_RESUME,
    ENV_RUN_NAME,
    Run,
    T,
    _env_float,
    _git,
    _package_version,
    _snapshot_source,
    _to_json,
)
from hindsight._run.files import Written
from hindsight._state import capture, capture_grads, rng_state, set_rng_state, tensor_bytes
from hindsight.errors import CorruptError, DivergenceError, HindsightError, NotFoundError, ReplayError


class RecordRun(Run):
    phase = "record"

    def __init__(self) -> None:
        super().__init__()
        self.resume_pending = False
        self.iterations_seen = 0
        self._prepared = False
        self.known = cmdline.Known()
        # A checkpoint written when the steps were closed early, until the
        # iteration is seen to go on (see Run._block).
        self.unconfirmed: str | None = None
        self.iter_checkpoint: str | None = None
        self.iter_materialize: float | None = None
        self.last_blocked: float | None = None
        # The training thread's time in this class's loop hooks, and the part
        # of it spent saving checkpoints: the rest is the recording's own
        # overhead, charged to the adaptive policy's budget too.
        self.own_seconds = 0.0
        self.save_seconds = 0.0
        # Preemption: a signal is noted by the handler and acted on at the next step boundary.
        self.signals = _preemption.StopSignals(_settings.flag(_settings.CATCH_SIGINT, False))
        self.requeue = _preemption.requeue_default()
        self.safety_seconds = _env_float(_settings.SAFETY_MINUTES, 60.0)
        _preemption.exit_code()  # a bad $HINDSIGHT_EXIT_CODE stops the run now, not at its preemption
        self.last_checkpoint_time = time.monotonic()
        self.resume: dict[str, Any] | None = None
        self.block_rng: dict[str, Any] | None = None
        # The RNG state when the current outer iteration started: code before
        # the steps may create the data iterator (`enumerate(loader)` draws
        # the shuffle order there), so a resume replays that code from it.
        self.iter_rng: dict[str, Any] | None = None
        # The RNG states when the first iteration began, kept with every
        # checkpoint: a replay worker executing from the first iteration
        # starts from them, so generators the script never seeded (Python's
        # `random`, NumPy's) draw as recorded.
        self.start_rng: dict[str, Any] | None = None
        self.block_iterable: Any = None
        # Fingerprints of the current iteration's batches, until written.
        self.batch_rows: list[tuple[int, int, str]] = []
        self.vars_checked = 0
        # When to checkpoint ($HINDSIGHT_CHECKPOINT_EVERY, $HINDSIGHT_EPSILON): the engine's rule.
        self.schedule = _native.CheckpointSchedule.from_env()
        self.files = Written(Path.cwd(), [self.home])
        self._start()
        self._wrap_excepthook()
        self.signals.install()
        atexit.register(self.finish)

    @property
    def stop_signal(self) -> int | None:
        return self.signals.received

    def _start(self) -> None:
        explicit = _settings.text(ENV_RUN_NAME)
        key = explicit or _native.resume_key(str(self.script), str(self.root), sys.argv[1:])
        prev = None
        if _settings.flag(ENV_RESUME, True):
            prev = self.db.run_to_resume(key, str(self.root), explicit is not None)
        if prev is not None:
            self.run_id = prev["id"]
            self.args = json.loads(prev["args_json"] or "{}")
            self.db.set_status(self.run_id, "running", False)
            self.recorded_store = prev.get("store")
            # The checkpoint is looked up when the outer loop starts: by then
            # hs.checkpointing has said where the store is.
            self.resume_pending = True
            print(f"hindsight: resuming run {self.run_id}", file=sys.stderr, flush=True)
            return
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
        torch = sys.modules.get("torch")
        if torch is not None:
            versions["torch_threads"] = torch.get_num_threads()  # replay says when its own differ
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

    def _wrap_excepthook(self) -> None:
        previous = sys.excepthook

        def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
            self.finish("interrupted" if issubclass(tp, KeyboardInterrupt) else "failed")
            previous(tp, value, tb)

        sys.excepthook = hook

    def arg(self, name: str, default: Any) -> Any:
        self.known.defaults[name] = default
        _, value = cmdline.parse(name, default)
        # Recorded as plain JSON (a numpy scalar as a number; NaN and
        # infinities as Python's json writes them, which the engine accepts).
        self.args[name] = _to_json(value, name, "hs.arg")
        self.db.set_args(self.run_id, json.dumps(self.args))
        return value

    def _open_store(self) -> tuple[str, str | None]:
        default = str(self.paths.store)
        configured = self._configured_store()
        if self.recorded_store:
            # A resumed run keeps writing where it wrote.
            location = self.recorded_store
            if configured is not None and configured != location:
                print(
                    f"hindsight: resuming in the run's store {location} (not {configured})", file=sys.stderr, flush=True
                )
        else:
            location = configured or default
        local = self._configured_local_first()
        if local == location:
            local = None
        if self.recorded_store != location:
            self.db.set_store(self.run_id, location)
            self.recorded_store = location
        return location, local

    def _block_closed(self, i: int) -> None:
        # Kept only if the iteration goes on (a break), not if the run fails.
        self.unconfirmed = self.iter_checkpoint

    def _iteration_continues(self) -> None:
        self.unconfirmed = None

    def _finish(self, status: str) -> None:
        try:
            if status != "completed" and self.unconfirmed is not None and self._store is not None:
                # The steps were left by an exception, not a break: their state
                # is no block end, and a resume must not start from it.
                name, self.unconfirmed = self.unconfirmed, None
                try:
                    self._store.remove(name)
                    print(f"hindsight: discarded checkpoint {name}: the run failed inside its steps", file=sys.stderr)
                except NotFoundError:
                    pass  # its save failed: there is nothing to discard
            self.signals.restore()
            note = self.files.note() if self.files is not None else None
            if note:
                print(note, file=sys.stderr, flush=True)
            if self.unkept:
                kept_out = "; ".join(f"'{k}' ({v})" for k, v in sorted(self.unkept.items()))
                print(
                    f"hindsight: note: not in this run's checkpoints: {kept_out}. The loop changes them through "
                    "method calls; a resume or a replay goes on with them as the code before the loop makes "
                    "them. If one holds training state, give it state_dict/load_state_dict and pass it to "
                    "hs.checkpointing.",
                    file=sys.stderr,
                    flush=True,
                )
            if self._store is not None:
                self._store.flush()
                if status == "completed":
                    self.apply_retention(final=True)
        finally:
            # Whatever went wrong above, the run's status is recorded: a
            # "running" left behind would be resumed by a plain rerun.
            self.db.set_status(self.run_id, status)

    # -- checkpoints -------------------------------------------------------------
    def _checkpoint_id(self, i: int, kind: str = "block", step: int | None = None) -> _native.CheckpointId:
        return _native.CheckpointId(self.run_id, self.outer_name or "loop", i, kind, step)

    def _save_now(self, ck: _native.CheckpointId, extra: dict[str, Any], wait: bool) -> None:
        t0 = time.perf_counter()
        try:
            self._save(ck, extra, wait, t0)
        finally:
            self.save_seconds += time.perf_counter() - t0

    def _save(self, ck: _native.CheckpointId, extra: dict[str, Any], wait: bool, t0: float) -> None:
        # The training thread's whole price: capturing the state too.
        state = self.capture()
        state.update(extra)
        if self.start_rng is not None:
            state["start_rng"] = self.start_rng  # the same bytes every time: stored once
        h = self.store.save(ck.name, state, meta={**ck.meta(), "run": self.run_id})
        # The steady-state price: one-time set-up of the first saves (fresh
        # staging, pinned buffers) is not what later checkpoints cost.
        self.last_blocked = max(0.0, time.perf_counter() - t0 - self.store.last_setup_seconds)
        self.schedule.saved(self.last_blocked)
        self.last_checkpoint_time = time.monotonic()
        if wait:
            h.wait()
            self.store.flush()

    def set_every(self, every: int) -> None:
        self.schedule.set_every(every)

    def _estimate_materialize(self) -> float:
        # A first guess, refined by the first save: host tensors are copied
        # while the training thread waits; a device tensor's copy is only
        # enqueued (the writer waits for it).
        nbytes = 0
        for obj in self.objects.values():
            state = obj.state_dict() if hasattr(obj, "state_dict") else {"t": obj}
            nbytes += tensor_bytes(state) - tensor_bytes(state, "cuda")
        return nbytes / 2e9

    def _end_block(self, i: int, at: str = "block") -> None:
        t0 = time.perf_counter()
        try:
            self._end_block_timed(i, at, t0)
        finally:
            self.own_seconds += time.perf_counter() - t0

    def _end_block_timed(self, i: int, at: str, t0: float) -> None:
        self.block_done = True
        if not self.objects:
            return
        if self.vars_checked < 2:
            # Refuse a loop variable that cannot be checkpointed now, not at
            # the first checkpoint the adaptive policy takes (maybe much
            # later); the second iteration sees those assigned after the steps.
            self.vars_checked += 1
            self.capture()
        compute = time.perf_counter() - self.iter_start
        background = self.store.background_cpu_seconds if self._store is not None else None
        first = self._estimate_materialize() if self.last_blocked is None else 0.0
        self.schedule.overhead(self.own_seconds + time.perf_counter() - t0 - self.save_seconds)
        if not self.schedule.block_ended(i, compute, background, first):
            return
        ck = self._checkpoint_id(i)
        # The values of the steps are in the database before the checkpoint
        # that covers them exists: a resume from it never re-logs them.
        self.flush_logs()
        extra: dict[str, Any] = {"at": at, "iter_rng": self.iter_rng}
        # After the steps may come the optimizer step of accumulated
        # gradients (nanoGPT's micro-steps): they are state then.
        grads = capture_grads(self.objects)
        if grads is not None:
            extra["grads"] = grads
        self._save_now(ck, extra, wait=False)
        self.iter_checkpoint = ck.name
        self.iter_materialize = self.last_blocked

    def apply_retention(self, final: bool = False) -> None:
        if not self.retention or self._store is None:
            return
        metric = self.retention.get("best_metric")
        if metric:
            self.flush_logs()
        self.store.apply_retention(
            self.run_id,
            keep_last=self.retention.get("keep_last"),
            keep_best=self.retention.get("keep_best"),
            best_mode=self.retention.get("best_mode", "min"),
            keep_every=self.retention.get("keep_every"),
            keep_spread=self.retention.get("keep_spread"),
            metrics=self._epoch_metric(metric) if metric else None,
        )
        if final:
            self.store.gc()

    def _epoch_metric(self, metric: str) -> dict[int, float]:
        """The outer-loop-level values of `metric` by iteration (what keep_best ranks)."""
        values: dict[int, float] = {}
        for rec in self.db.logs(self.run_id, [metric]):
            if len(rec.ctx) == 1 and rec.phase == "record":
                try:
                    values[rec.ctx[0][1]] = float(json.loads(rec.value_json))
                except (TypeError, ValueError):
                    pass  # not a number at that iteration: not ranked
        return values

    # -- preemption and resume ----------------------------------------------------
    def _latest_checkpoint(self) -> dict[str, Any] | None:
        """The newest complete checkpoint of this run (listed = complete)."""
        for ck in reversed(self.store.checkpoints(self.run_id)):
            try:
                state = self.store.load(ck.name)
            except CorruptError as e:
                # Damaged (a race with another process is not reported as
                # corruption): fall back to the previous one, and say so.
                print(
                    f"hindsight: WARNING: checkpoint {ck.name} is damaged ({e}); resuming from an older one",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            kind = ck.kind
            if kind == "block" and state.get("at") == "iteration":
                kind = "end"  # taken at the end of an outer iteration without an inner hs.loop
            return {"name": ck.name, "kind": kind, "epoch": ck.index, "step": ck.step or 0, "state": state}
        return None

    def parse_args(self, parser: Any, argv: list[str] | None) -> Any:
        """`hs.args(parser)`: parse as the script always did, record the result."""
        self.known.add_parser(parser)
        # Known args only: flags of hs.arg live beside the parser's; what
        # neither knows is refused when the loop starts (cmdline.Known.check).
        try:
            ns, _ = parser.parse_known_args(argv)
        except SystemExit:
            self._nothing_ran()  # --help, or arguments the parser refused
            raise
        for k, v in vars(ns).items():
            self.args[k] = _to_json(v, k, "hs.args")
        self.db.set_args(self.run_id, json.dumps(self.args))
        return ns

    def _nothing_ran(self) -> None:
        """The script leaves before training (argparse's --help or usage
        error): a new run is deleted, so it never becomes "the latest run"
        with no iterations; a resumed one stays interrupted."""
        self.finished = True
        self.flush_logs()
        self.log_queue.put(None)
        self.signals.restore()
        if self.resume_pending:
            self.db.set_status(self.run_id, "interrupted", False)
        else:
            self.db.delete_run(self.run_id)

    def _outer_starts(self) -> None:
        # Arguments are declared by now: a misspelt --flag must not run silently.
        self.known.check(str(self.script.name))
        if not self.resume_pending:
            return
        self.resume_pending = False
        self.resume = self._latest_checkpoint()
        if self.resume is not None:
            self.start_rng = self.resume["state"].get("start_rng")
        where = "the start" if self.resume is None else f"checkpoint {self.resume['name']}"
        print(
            f"hindsight: run {self.run_id} continues from {where} (store {self.store.path})",
            file=sys.stderr,
            flush=True,
        )

    def _visit(self, i: int) -> bool | None:
        self.iter_checkpoint = None
        self.iter_materialize = None
        self.iterations_seen = i + 1
        resume = self.resume
        if resume is None:
            return True
        first = resume["epoch"] + 1 if resume["kind"] == "end" else resume["epoch"]
        if i < first:
            return False  # done before the interruption; its state is in the checkpoint
        if resume["kind"] == "end":
            self._apply(resume["state"], resume["name"])
            self.resume = None
        else:
            # Interrupted in (or after) the steps of iteration i: the code
            # before the steps runs again as it first ran, from the RNG
            # state and the loop's variables it started with (it may create
            # the data iterator and draw its order, or evaluate when the
            # iteration counter says so).
            state = resume["state"]
            if state.get("iter_rng") is not None:
                set_rng_state(state["iter_rng"])
            at_start = (state.get("vars") or {}).get("iter")
            if at_start and self.outer_vars is not None:
                self.outer_vars.restore(at_start)
        return True

    def _outer_ends(self) -> None:
        resume = self.resume
        if resume is None:
            return
        self.resume = None
        n = self.iterations_seen
        if resume["kind"] == "end" and resume["epoch"] == n - 1:
            # Interrupted after the last iteration: nothing is left to run,
            # but the code after the loop reads the state it ended with.
            self._apply(resume["state"], resume["name"])
            return
        raise ReplayError(
            f"resume of run {self.run_id}: checkpoint {resume['name']} is at {self.outer_name} {resume['epoch']}, "
            f"but the loop now ends after {n} iterations: the script's arguments or data changed since the "
            "run was interrupted (HINDSIGHT_RESUME=0 starts a new run)"
        )

    def _start_is_stale(self, i: int) -> bool:
        # Resumed inside iteration i's steps: the code before them runs again
        # (it may make the data iterator), but on the objects as the process
        # started them, not as they were then (nanoGPT's estimate_loss() on
        # initial weights). The interrupted run logged its values already.
        r = self.resume
        return r is not None and r["epoch"] == i and r["kind"] in ("step", "block")

    def _iteration_starts(self, i: int) -> None:
        t0 = time.perf_counter()
        super()._iteration_starts(i)
        self.iter_rng = rng_state()
        if i == 0:
            self.start_rng = self.iter_rng
        self.own_seconds += time.perf_counter() - t0

    def _skip_block(self, i: int) -> bool:
        resume = self.resume
        if resume is not None and resume["epoch"] == i and resume["kind"] == "block":
            # Interrupted after this block's checkpoint: restore it, skip the steps.
            self.resume = None
            self._apply(resume["state"], resume["name"])
            return True
        return False

    def _block_iter(self, i: int, iterable: Iterable[T]) -> tuple[Iterator[T], int]:
        self.block_iterable = iterable
        resume = self.resume
        if resume is not None and resume["epoch"] == i and resume["kind"] == "step":
            self.resume = None
            return self._resume_steps(iterable, resume)
        self.block_rng = rng_state()  # before iter(): a DataLoader draws its order here
        return iter(iterable), 0

    def _resume_steps(self, iterable: Any, resume: dict[str, Any]) -> tuple[Iterator[Any], int]:
        """Continue an interrupted block exactly: same data order, no sample repeated or skipped."""
        state = resume["state"]
        self._apply(state, resume["name"], rng=False)
        done = int(state["position"][1]) + 1
        i = int(state["position"][0])
        self.iter_rng = state.get("iter_rng")
        self.block_rng = state["block_rng"]
        if "loader_state" in state and hasattr(iterable, "load_state_dict"):
            iterable.load_state_dict(state["loader_state"])  # a stateful loader knows its own position
            it = iter(iterable)
        else:
            if iter(iterable) is not iterable:
                # A re-iterable (a DataLoader): re-create the epoch's order
                # from the RNG state it was drawn from.
                set_rng_state(state["block_rng"])
            # else an iterator made before the steps (`enumerate(loader)`),
            # re-created from the iteration's start state (see _visit).
            it = iter(iterable)
            # Step over what was consumed before the interruption, proving
            # on the way that it is what the recording consumed.
            self._advance_checked(it, i, done)
        set_rng_state(state["rng"])
        return it, done

    def _advance_checked(self, it: Iterator[Any], i: int, n: int) -> None:
        recorded = self.db.batch_digests(self.run_id, i)
        if not recorded or n == 0:
            dataiter.advance(it, n)  # recorded before fingerprints existed
            return
        if dataiter.skips_loading(it):
            # Nothing loaded, nothing to compare: the steps that follow are.
            dataiter.advance(it, n)
            return
        for j in range(n):
            batch = next(it)
            if j in recorded and batches.digest(batch) != recorded[j]:
                raise DivergenceError(
                    f"resume of run {self.run_id}: the batch at {self.outer_name} {i}, step {j} differs from "
                    "the recorded one: the data loader's order or content was not restored (a sampler or "
                    "iterator drawing from a generator hindsight does not checkpoint, or data that changed "
                    "on disk); use hs.data.Loader, or a DataLoader with a seeded generator, or start the "
                    "epoch afresh (HINDSIGHT_RESUME=0 starts a new run)"
                )

    def _block_ends(self) -> None:
        self.block_iterable = None

    def _step_starts(self, i: int, j: int, batch: Any) -> None:
        t0 = time.perf_counter()
        self.batch_rows.append((i, j, batches.digest(batch)))
        self.own_seconds += time.perf_counter() - t0

    def _flush_buffers(self) -> None:
        super()._flush_buffers()
        if self.batch_rows:
            rows, self.batch_rows = self.batch_rows, []
            for i in sorted({r[0] for r in rows}):
                steps = [(j, d) for k, j, d in rows if k == i]
                self._submit(functools.partial(self.db.record_batches, self.run_id, i, steps))

    def _step_boundary(self, i: int, j: int) -> None:
        """Between two training steps: act on a signal or a due safety checkpoint."""
        t0 = time.perf_counter()
        try:
            self._step_boundary_timed(i, j)
        finally:
            self.own_seconds += time.perf_counter() - t0

    def _step_boundary_timed(self, i: int, j: int) -> None:
        if not self.objects:
            if self.stop_signal is not None:
                self._exit_for_signal()
            return
        if not self._prepared:
            # After the first step the optimizer's state exists: pin host
            # memory for the whole state now, in the background, so the
            # first checkpoint does not wait for it.
            self._prepared = True
            self.store.prepare(capture(self.objects, []))
        due = self.safety_seconds is not None and time.monotonic() - self.last_checkpoint_time > self.safety_seconds
        if self.stop_signal is None and not due:
            return
        mid = {"block_rng": self.block_rng, "iter_rng": self.iter_rng, "position": [i, j]}
        loader = self.block_iterable
        if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict") and not hasattr(loader, "parameters"):
            mid["loader_state"] = loader.state_dict()
        # Between two steps may be between two optimizer steps too (gradient
        # accumulation): the gradients so far are part of the state then.
        grads = capture_grads(self.objects)
        if grads is not None:
            mid["grads"] = grads
        self.flush_logs()
        self._save_now(self._checkpoint_id(i, "step", j), mid, wait=self.stop_signal is not None)
        if self.stop_signal is not None:
            self._exit_for_signal()

    def _end_iteration(self, i: int, closing: bool = False) -> None:
        t0 = time.perf_counter()
        try:
            self._end_iteration_timed(i, closing)
        finally:
            self.own_seconds += time.perf_counter() - t0

    def _end_iteration_timed(self, i: int, closing: bool) -> None:
        self.db.record_iteration(
            self.run_id,
            self.outer_name or "",
            i,
            time.perf_counter() - self.iter_start,
            self.iter_checkpoint,
            self.iter_materialize,
            None if self.outer_value is None else int(self.outer_value),
        )
        if self.retention and self.iter_checkpoint is not None:
            self.flush_logs()
            self.apply_retention()
        self.flush_logs()
        if self.stop_signal is not None and not closing:
            # After outer iteration i: the next iteration starts afresh on resume.
            if self.objects:
                self._save_now(self._checkpoint_id(i, "end"), {}, wait=True)
            self._exit_for_signal()

    def _exit_for_signal(self) -> None:
        sig = self.stop_signal
        self.interrupted()
        _preemption.leave(sig, f"run {self.run_id}", self.exit_code, requeue=self.requeue)

    def interrupted(self) -> None:
        """Logs and checkpoints durable, the run marked `interrupted` (so the
        same command resumes it), before the process leaves for a signal."""
        self.flush_logs()
        if self._store is not None:
            self._store.flush()
        self.db.set_status(self.run_id, "interrupted")
        self.finished = True
        self.signals.restore()

    def add_args(self, params: dict[str, Any], source: str) -> None:
        """Arguments a framework parsed (Lightning's hyper-parameters), recorded
        beside hs.arg's; values that are not JSON are left out, saying which."""
        for k, v in params.items():
            try:
                self.args[k] = _to_json(v, k, source)
            except HindsightError as e:
                print(f"hindsight: {source} {k!r} not recorded: {e}", file=sys.stderr)
        self.db.set_args(self.run_id, json.dumps(self.args))

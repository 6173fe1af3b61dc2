"""Recording (a plain `python train.py`): arguments, source, logs and, at the
end of the first `hs.loop` nested in the outer loop (the training steps) of
each outer iteration, a checkpoint of the objects given to `hs.checkpointing`
plus the RNG states, when the adaptive policy says it is worth it. Also
preemption (checkpoint at the next step boundary, then exit) and resume."""

from __future__ import annotations

import atexit
import functools
import itertools
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from hindsight import _native, _preemption, _settings, _startup
from hindsight._run import batches, cmdline, dataiter, jupyter
from hindsight._run.common import (
    ENV_RESUME,
    ENV_RUN_NAME,
    Run,
    T,
    _git,
    _package_version,
    _snapshot_source,
    job_part,
)
from hindsight._run.files import Written
from hindsight._run.loopvars import _storages
from hindsight._run.ranks import lost_peer
from hindsight._run.restoreprice import RestorePrice
from hindsight._run.values import _to_json
from hindsight._state import capture, capture_grads, rng_state, set_rng_state, tensor_bytes
from hindsight.errors import (
    CorruptError,
    DivergenceError,
    HindsightError,
    InvalidArgumentError,
    NotFoundError,
    ReplayError,
)

#: What a recorded fingerprint is of (core `runs::db::PrintKind`).
PrintKind = Literal["batch", "order"]


def _stateful_loader(loader: Any) -> bool:
    """A loader that knows its own position (torchdata's StatefulDataLoader).
    Accelerate's prepared DataLoader has state_dict/load_state_dict always,
    but they work only over a StatefulDataLoader (use_stateful_dataloader)."""
    if getattr(loader, "use_stateful_dataloader", None) is False:
        return False
    return hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict") and not hasattr(loader, "parameters")


#: The clock of the recording's own work on the training thread: its CPU
#: time. Wall time inside a hook also counts the waits for the GIL another
#: thread held (the log thread, a pinning thread), which cost the process no
#: CPU: minGPT's hooks took 0.32 s of wall against about 0.12 s of CPU, and
#: charged at wall they left checkpoints half of the budget they had.
_own_clock = time.thread_time


class RecordRun(Run):
    """The frame, iterator and state plumbing of a recording. Every decision
    (resume point, when to save, the preemption sequence, retention) is the
    session's (`_native.RecordSession`, core `runs::session`).

    Why about 30 attributes more than `Run`'s: they are the state the
    session's answers are carried out with, in five groups: the resume
    (resume_pending, resume_state, continued, lease, reshard), saves
    (handles, dist_save, sharded, and the costs the policy is told:
    own_seconds, save_seconds, last_blocked, iter_materialize, `restore`),
    the RNG states a checkpoint keeps (start_rng, iter_rng, block_rng), the
    proofs of the data (batch_rows, order_tap, block_iterable, iter_rows),
    and what the run says (quiet, verbose, announced, signals,
    agreed_signal). Restore pricing had a thread of its own and moved out
    (`RestorePrice`)."""

    phase = "record"

    def __init__(self) -> None:
        # This set-up and hindsight's import are the recording's start-up:
        # CPU the plain script does not spend, charged to the ε budget.
        t0 = _own_clock()
        # The signal the ranks agreed on (any rank's), for the exit line.
        self.agreed_signal: int | None = None
        # The multi-rank checkpoint whose parts are written but not yet committed.
        self.dist_save: Any = None
        # Whether checkpoints are saved the job's way (`hindsight.dist`): set at the first save.
        self.sharded: bool | None = None
        super().__init__()
        self.resume_pending = False
        # The run held by this process (core `runs::lease`), from `_start` to `_finish`.
        self.lease: _native.RunLease | None = None
        # This process continues an interrupted run (a relaunch after a preemption).
        self.continued = False
        self.known = cmdline.Known()
        self.iter_materialize: float | None = None
        self.last_blocked: float | None = None
        # What a restore costs, for the adaptive policy.
        self.restore = RestorePrice()
        # The training thread's time in this class's loop hooks, and the part
        # of it spent saving checkpoints: the rest is the recording's own
        # overhead, charged to the adaptive policy's budget too.
        self.own_seconds = 0.0
        self.save_seconds = 0.0
        # Preemption: a signal is noted by the handler and acted on at the next step boundary.
        self.signals = _preemption.StopSignals(_settings.flag(_settings.CATCH_SIGINT, False))
        self.requeue = _preemption.requeue_default()
        # The checkpoint a resume starts from, loaded when the outer loop starts.
        self.resume_state: dict[str, Any] | None = None
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
        # Fingerprints of the batches consumed, (rank, kind, iteration,
        # step, digest), until written (a following rank's: until sent to
        # rank 0); the block's loader when a resume would skip it unloaded.
        self.batch_rows: list[tuple[int, PrintKind, int, int, str]] = []
        # The outer iterations ended since the last hand-over to the log thread.
        self.iter_rows: list[tuple[str, _native.Iteration]] = []
        self.order_tap: Any = None
        self.vars_checked = 0
        # What the run says for itself: a line when its loop starts and when
        # it ends ($HINDSIGHT_QUIET=1: none), one per checkpoint decision
        # ($HINDSIGHT_VERBOSE=1), and the saves whose bytes the end line sums.
        self.quiet = _settings.flag(_settings.QUIET, False)
        self.verbose = _settings.flag(_settings.VERBOSE, False)
        # A relaunch on another world size resumes by resharding (opt-in: not exact).
        self.reshard = _settings.flag(_settings.RESHARD, False)
        self.announced = False
        self.handles: list[Any] = []
        # Files the script writes are rank 0's to keep: every rank would write the same paths.
        self.files = Written(Path.cwd(), [self.home]) if self.leads else None
        # A bad HINDSIGHT_* setting stops the run now, not at its first
        # checkpoint or preemption, and before a run is created (or resumed).
        self.session = _native.RecordSession.from_env("", time.monotonic())
        if self.leads:
            self._start()
            self.session.join(self.run_id, time.monotonic())
        self._wrap_excepthook()
        if jupyter.shell() is not None:
            jupyter.on_cell_error(self)
        self.signals.install()
        atexit.register(self.finish)
        self.session.started(_startup.take_import_seconds() + _own_clock() - t0)

    @property
    def stop_signal(self) -> int | None:
        return self.agreed_signal if self.ranks is not None else self.signals.received

    def _sync(self) -> float:
        """Tell the session what changed outside its events: a signal the
        handler noted, objects given or dropped by hs.checkpointing. Under
        several ranks this is where they meet: a signal any rank got counts
        on every rank, and they share one clock (the latest), so every
        session takes the same step. Returns that clock."""
        now = time.monotonic()
        signum = self.signals.received
        if self.ranks is not None:
            got, now = self.ranks.agree([float(signum or 0), now])
            signum = int(got) or None
            if signum is not None and self.agreed_signal is None:
                self.agreed_signal = signum
        if signum is not None:
            self.session.signal(signum)
        self.session.set_objects(bool(self.objects))
        return now

    def configure(
        self,
        every: int | None,
        safety_minutes: float | None,
        exit_code: int | None,
        retention: _native.Retention | None,
    ) -> None:
        if every is not None:
            self.session.set_every(every)
        if safety_minutes is not None:
            self.session.set_safety_minutes(safety_minutes)
        if exit_code is not None:
            self.session.set_exit_code(exit_code)
        if retention is not None:
            self.session.set_retention(retention)

    def _start(self) -> None:
        explicit = _settings.text(ENV_RUN_NAME)
        nb, argv = jupyter.program()
        key = explicit or _native.resume_key(str(self.script), str(self.root), argv[1:])
        prev = None
        if _settings.flag(ENV_RESUME, True):
            prev = self.db.run_to_resume(key, str(self.root), str(self.script), argv[1:], explicit is not None)
        if prev is not None:
            # One process holds a run: of two launches that both found it,
            # the second is refused, naming the first (core `runs::lease`).
            # Held, it is looked up again: the holder before this one may
            # have finished it meanwhile (this command then starts anew).
            self.lease = _native.RunLease.hold(str(self.home), prev.id)
            again = self.db.run_to_resume(key, str(self.root), str(self.script), argv[1:], explicit is not None)
            if again is None or again.id != prev.id:
                self.lease.release()
                prev = None
        if prev is not None:
            self.run_id = prev.id
            self.args = json.loads(prev.args_json or "{}")
            self.db.set_status(self.run_id, "running", False)
            self.recorded_store = prev.store
            # The checkpoint is looked up when the outer loop starts: by then
            # hs.checkpointing has said where the store is.
            self.resume_pending = True
            self.continued = True
            print(f"hindsight: resuming run {self.run_id}", file=sys.stderr, flush=True)
            return
        # A notebook's source is the cells its kernel ran, as a script (jupyter.py).
        files = _snapshot_source(self.root, self.script, None if nb is None else jupyter.recorded_source(nb))
        source_hash = self.db.put_source(files)
        commit, dirty = _git(self.root)
        versions = {
            "python": platform.python_version(),
            "hindsight": _package_version(),
            "argv": argv,
            "cwd": os.getcwd(),
            "executable": sys.executable,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            # A run of several ranks is one run; a replay refuses it (core `runs::ranks`).
            "world_size": 1 if self.ranks is None else self.ranks.size,
            # torchrun even on one rank: its replay runs the script under it (core `runs::ranks`).
            "launcher": None if self.world is None else self.world.launcher,
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
        self.lease = _native.RunLease.hold(str(self.home), self.run_id)

    def _wrap_excepthook(self) -> None:
        previous = sys.excepthook

        def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
            status = "failed"
            if issubclass(tp, KeyboardInterrupt):
                status = "interrupted"
            elif self.ranks is not None and lost_peer(value):
                # Another rank died (kill -9, OOM) and this one's collective
                # failed: the job was interrupted, not wrong. A relaunch
                # resumes from the last checkpoint every rank committed.
                status = "interrupted"
                if self.leads:
                    print(
                        f"hindsight: run {self.run_id}: another rank of the job was lost ({tp.__name__}); "
                        "the run is left interrupted: run the same command again to resume it",
                        file=sys.stderr,
                        flush=True,
                    )
            self.finish(status)
            previous(tp, value, tb)

        sys.excepthook = hook

    def arg(self, name: str, default: Any) -> Any:
        self.known.defaults[name] = default
        try:
            _, value = cmdline.parse(name, default)
        except InvalidArgumentError:
            self._nothing_ran()  # a command line refused leaves no run behind
            raise
        # Recorded as plain JSON (a numpy scalar as a number; NaN and
        # infinities as Python's json writes them, which the engine accepts).
        self.args[name] = _to_json(value, name, "hs.arg")
        if self.leads:
            self.db.set_args(self.run_id, json.dumps(self.args))
        return value

    def _open_store(self) -> tuple[str, str | None]:
        # Core's rule (`runs::store_choice`): a resumed run keeps writing where it wrote.
        c = _native.choose_store(self.paths.home, self.recorded_store or None, self.store_location, self.local_first)
        if c.declined is not None:
            print(
                f"hindsight: resuming in the run's store {c.location} (not {c.declined})", file=sys.stderr, flush=True
            )
        if self.recorded_store != c.location:
            if self.leads:
                self.db.set_store(self.run_id, c.location)
            self.recorded_store = c.location
        return c.location, c.local_first

    def _block_closed(self, i: int) -> None:
        self.session.block_closed(i)

    def _iteration_continues(self) -> None:
        self.session.iteration_continues()

    def _finish(self, status: str) -> None:
        if status == "completed" and self.resume_pending and jupyter.shell() is not None:
            # A kernel resumed the run (a cell called hs.*) but never ran its
            # loop (the training cell was not run): the run is no more done
            # than it was, and running the notebook again must still resume it.
            status = "interrupted"
        if not self.leads:
            # The run, its status and its retention are rank 0's.
            self.session.finish(status)
            self.signals.restore()
            if self._store is not None:
                self._store.flush()
            return
        try:
            end = self.session.finish(status)
            name = end.discard
            if name is not None and self._store is not None:
                # The steps were left by an exception, not a break: their state
                # is no block end, and a resume must not start from it.
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
            if self.dist_save is not None and status == "completed":
                self._commit()  # its parts are durable once every rank is done (a failed job's may never be)
            if self._store is not None:
                self._store.flush()
                if end.apply_retention:
                    self.apply_retention(final=True)
            if self.announced and not self.quiet:
                line = self.session.summary(status, self._script_rel(), self._bytes_written(), time.monotonic())
                print(line, file=sys.stderr, flush=True)
        finally:
            # Whatever went wrong above, the run's status is recorded: a
            # "running" left behind would be resumed by a plain rerun.
            self.db.set_status(self.run_id, status)
            if self.lease is not None:
                self.lease.release()  # then it is another process's to resume

    # -- checkpoints -------------------------------------------------------------
    def _save_now(self, name: str, extra: dict[str, Any], wait: bool) -> None:
        t0, c0 = time.perf_counter(), _own_clock()
        ck = _native.CheckpointId.parse(name)
        assert ck is not None, name  # named by the session
        try:
            self._save(ck, extra, wait, t0)
        finally:
            self.save_seconds += _own_clock() - c0

    def _save(self, ck: _native.CheckpointId, extra: dict[str, Any], wait: bool, t0: float) -> None:
        # The training thread's whole price: capturing the state too.
        state = self.capture()
        state.update(extra)
        nbytes = tensor_bytes(state)  # what the budget counts (before a sharded save splits it)
        if self.start_rng is not None:
            state["start_rng"] = self.start_rng  # the same bytes every time: stored once
        meta = {**ck.meta(), "run": self.run_id}
        if "at" in extra:  # a replay's planner reads whether it holds a whole iteration
            meta["at"] = extra["at"]
        from hindsight import dist

        # FSDP2 on one rank (one GPU) is sharded too: its DTensors are saved
        # the job's way, which a plain save refuses. Looked for once: a
        # model is sharded before it trains.
        if self.sharded is None:
            self.sharded = self.ranks is not None or dist.holds_dtensor(state["objects"])
        if not self.sharded:
            h = self.store.save(ck.name, state, meta=meta)
        else:
            # One checkpoint of the job: the objects (replicated under DDP,
            # sharded under FSDP) split between the ranks, the rest (RNG
            # streams, loop variables, the data position) kept per rank.
            shared = job_part(state, "grads" in state and dist.holds_dtensor(state["grads"]))
            self._commit()
            # Rank 0 commits on its own once every part is durable: the
            # ranks need not meet again for it (one may die first).
            self.dist_save = dist.save(self.store, ck.name, shared, rank_state=state, meta=meta, _background=True)
            h = self.dist_save.part
        self.handles.append(h)
        # The steady-state price: one-time set-up of the first saves (fresh
        # staging, pinned buffers) is not what later checkpoints cost.
        self.last_blocked = max(0.0, time.perf_counter() - t0 - self.store.last_setup_seconds)
        now = time.monotonic()
        if self.ranks is not None:
            # The job waits for its slowest rank: that is what a save costs it.
            self.last_blocked, now = self.ranks.agree([self.last_blocked, now])
        self.session.saved(self.last_blocked, now)
        self.session.checkpoint_size(nbytes)
        if wait:
            self._commit()
            h.wait()
            self.store.flush()

    def _commit(self) -> None:
        """Rank 0: the pending multi-rank checkpoint is committed (its
        error raised); another rank: its part is durable."""
        if self.dist_save is not None:
            pending, self.dist_save = self.dist_save, None
            pending.committed()

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
        t0 = _own_clock()
        try:
            self._end_block_timed(i, at, t0)
        finally:
            self.own_seconds += _own_clock() - t0

    def _end_block_timed(self, i: int, at: str, t0: float) -> None:
        self.pos.block_done = True
        self._sync()
        if not self.objects:
            return
        if self.vars_checked < 2:
            # Refuse a loop variable that cannot be checkpointed now, not at
            # the first checkpoint the adaptive policy takes (maybe much
            # later); the second iteration sees those assigned after the steps.
            self.vars_checked += 1
            self.capture()
        compute = time.perf_counter() - self.pos.iter_start
        self._price_restore()
        background = self.store.background_cpu_seconds + self.restore.cpu if self._store is not None else None
        first = self._estimate_materialize() if self.last_blocked is None else 0.0
        # The log thread's CPU too: the recording's own work, off this thread.
        self.session.overhead(self.own_seconds + _own_clock() - t0 - self.save_seconds + self.logs.cpu_seconds)
        block = None
        if self.leads:
            block = self.session.block_end(i, compute, background, first)
        if self.ranks is not None:
            # Rank 0's measurements decide for the job (each rank's own
            # would differ, and so would their checkpoints).
            (due,) = self.ranks.agree([1.0 if self.leads and block is not None else 0.0])
            if not self.leads:
                block = self.session.block_end_decided(i, due > 0)
        if self.verbose:
            decision = self.session.take_decision()
            if decision:
                print(f"hindsight: {decision}", file=sys.stderr, flush=True)
        if block is None:
            return
        name = block.name
        # The values of the steps are in the database before the checkpoint
        # that covers them exists: a resume from it never re-logs them.
        self._gather_ranks_values()
        self.flush_logs()
        extra: dict[str, Any] = {"at": at, "iter_rng": self.iter_rng}
        # After the steps may come the optimizer step of accumulated
        # gradients (nanoGPT's micro-steps): they are state then.
        grads = capture_grads(self.objects)
        if grads is not None:
            extra["grads"] = grads
        self._save_now(name, extra, wait=False)
        self.iter_materialize = self.last_blocked

    def _price_restore(self) -> None:
        """Price a restore once (`RestorePrice`): rank 0 decides for a job; a
        job's sharded checkpoints are not priced (they keep the ε rule alone)."""
        if self.sharded or not self.leads:
            return
        secs = self.restore.poll(self.handles[0] if self.handles else None, self._store)
        if secs is not None:
            self.session.restore_measured(secs)

    def apply_retention(self, final: bool = False) -> None:
        """The session's policy (the user's, or the loop's default) on this run's checkpoints."""
        policy = self.session.retention
        if policy.is_empty() or self._store is None or not self.leads:
            return
        metric = policy.metric
        if metric:
            self.flush_logs()
        # keep_best ranks by the values logged under the metric.
        self.store.apply_policy(self.run_id, policy, metrics=self._epoch_metric(metric) if metric else None)
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
    def _latest_checkpoint(self, names: list[str] | None = None) -> tuple[str, dict[str, Any]] | None:
        """The newest complete checkpoint of this run that reads back
        (listed = complete); under $HINDSIGHT_RESHARD on another world size,
        the newest between iterations. Under several ranks every rank walks
        rank 0's ``names`` (newest first), each loading its own part: a
        part damaged on any rank sends the whole job to an older one."""
        # Core's resume walk: which checkpoints, newest first.
        walk = (
            _native.ResumeWalk.run(self.store.list(), self.run_id) if names is None else _native.ResumeWalk.given(names)
        )
        skipped: list[str] = []
        for name in walk:
            damage: CorruptError | None = None
            try:
                state = self.load_checkpoint(name, self.reshard)
            except CorruptError as e:
                # Damaged (a race with another process is not reported as
                # corruption): fall back to the previous one, and say so.
                state, damage = None, e
            elsewhere = False
            if self.ranks is not None:
                (worst,) = self.ranks.agree([float(damage is not None)])
                elsewhere = damage is None and worst > 0
            if damage is not None or elsewhere:
                if damage is not None or self.leads:
                    why = str(damage) if damage is not None else "another rank's part"
                    print(_native.ResumeWalk.damaged(name, why), file=sys.stderr, flush=True)
                continue
            if state is None:
                skipped.append(name)
                continue
            if self.leads:
                self._say_resharded(name, skipped)
            return name, state
        return None

    def _say_resharded(self, name: str, skipped: list[str]) -> None:
        """Rank 0: what a resume on another world size keeps and what not."""
        saved = self.store.info(name)["meta"].get(_native.META_WORLD)
        size = 1 if self.ranks is None else self.ranks.size
        if int(saved or 1) == size:
            return
        print(
            f"hindsight: {_settings.RESHARD}=1: checkpoint {name} was saved by {int(saved or 1)} rank(s) and this "
            f"launch has {size}: the model and optimizer are resharded onto it exactly; ranks the checkpoint has "
            "continue their RNG streams, new ranks keep the ones the script seeded, and the data order from here "
            "on is this world size's" + (f" (skipped, inside an iteration: {', '.join(skipped)})" if skipped else ""),
            file=sys.stderr,
            flush=True,
        )

    def parse_args(self, parser: Any, argv: list[str] | None) -> Any:
        """`hs.args(parser)`: parse as the script always did, record the result."""
        self.known.add_parser(parser)
        # Known args only: flags of hs.arg live beside the parser's; what
        # neither knows is refused when the loop starts (cmdline.Known.check).
        try:
            ns, _ = parser.parse_known_args(argv if argv is not None else jupyter.program()[1][1:])
        except SystemExit:
            self._nothing_ran()  # --help, or arguments the parser refused
            raise
        for k, v in vars(ns).items():
            self.args[k] = _to_json(v, k, "hs.args")
        if self.leads:
            self.db.set_args(self.run_id, json.dumps(self.args))
        return ns

    def _nothing_ran(self) -> None:
        """The script leaves before training (argparse's --help or usage
        error): a new run is deleted, so it never becomes "the latest run"
        with no iterations; a resumed one stays interrupted."""
        self.finished = True
        self._flush_buffers()
        self.logs.close()
        self.signals.restore()
        if not self.leads:
            return
        if self.resume_pending:
            self.db.set_status(self.run_id, "interrupted", False)
        else:
            self.db.delete_run(self.run_id)

    def _outer_starts(self, name: str, length: int | None) -> None:
        # Arguments are declared by now: a misspelt --flag must not run
        # silently, nor leave a failed run behind (nothing ran).
        try:
            self.known.check(str(self.script.name))
        except (InvalidArgumentError, SystemExit):
            self._nothing_ran()
            raise
        try:
            if self.ranks is not None:
                latest = self._join()
            else:
                latest = self._latest_checkpoint() if self.resume_pending else None
        except InvalidArgumentError:
            # Refused before anything ran (a resume on another world size):
            # the run stays interrupted, for a relaunch that can resume it.
            self._nothing_ran()
            raise
        self._sync()
        self.session.outer_start(name, length)
        if not self.resume_pending:
            if not self.announced:
                self._announce()
            return
        self.resume_pending = False
        if latest is not None:
            ck_name, state = latest
            # A block checkpoint taken at the end of an iteration without an inner hs.loop holds all of it.
            self.session.resume_from(ck_name, state.get("at") == "iteration")
            self.resume_state = state
            self.start_rng = state.get("start_rng")
        where = "the start" if latest is None else f"checkpoint {latest[0]}"
        if self.leads:
            print(
                f"hindsight: run {self.run_id} continues from {where} (store {self.store.path})",
                file=sys.stderr,
                flush=True,
            )
        self.announced = True

    def _join(self) -> tuple[str, dict[str, Any]] | None:
        """The ranks meet as the outer loop starts: rank 0 says the run, its
        store and the checkpoint it resumes from (or the error that stops
        it, which then stops every rank); each rank loads that checkpoint
        for itself; they agree on a clock."""
        ranks = self.ranks
        assert ranks is not None
        ranks.check()
        latest = None
        payload: dict[str, Any] | None = None
        failure: BaseException | None = None
        if ranks.leads:
            try:
                names = _native.ResumeWalk.run(self.store.list(), self.run_id).order if self.resume_pending else []
                payload = {
                    "run": self.run_id,
                    "store": self.store.path,
                    "resume": self.resume_pending,
                    "checkpoints": names,
                }
            except Exception as e:  # noqa: BLE001 - re-raised below; every rank must stop, not wait for rank 0
                failure = e
                payload = {"error": f"{type(e).__name__}: {e}"}
        payload = ranks.from_leader(payload)
        if failure is not None:
            raise failure
        if "error" in payload:
            raise InvalidArgumentError(f"rank 0 could not start the job's run: {payload['error']}")
        if not ranks.leads:
            self.run_id = payload["run"]
            self.recorded_store = payload["store"]
            self.resume_pending = self.continued = bool(payload["resume"])
            self.announced = True  # rank 0 speaks for the job
        if payload["checkpoints"]:
            latest = self._latest_checkpoint(payload["checkpoints"])
        (now,) = ranks.agree([time.monotonic()])
        self.session.join(self.run_id, now)
        return latest

    def _announce(self) -> None:
        """The first line of a new recording: the run, its home, what its
        checkpoints hold (hands-free finds included) and when they are taken."""
        self.announced = True
        if self.quiet:
            return
        objects = list(self.objects)
        if objects:
            objects.append("RNG states")
            # The loop's own variables are found as it runs: `--explain` lists them.
            objects.append(f"loop variables (hindsight record --explain {self._script_rel()})")
        line = self.session.start_line(self._script_rel(), str(self.home), objects, False)
        print(line, file=sys.stderr, flush=True)

    def _script_rel(self) -> str:
        try:
            return str(self.script.relative_to(Path.cwd()))
        except ValueError:
            return str(self.script)

    def _bytes_written(self) -> int | None:
        """What this process's saves wrote (new chunks only: dedup at work)."""
        total = 0
        try:
            for h in self.handles:
                stats = h.wait(0)
                if stats is None:
                    return None
                total += int(stats["bytes_written"])
        except HindsightError:
            return None  # a failed save was already reported
        return total

    def _resumed(self, name: str | None) -> tuple[str, dict[str, Any]]:
        """The checkpoint the session resumes from, and its state."""
        if self.resume_state is None or name is None:
            raise ReplayError(f"resume of run {self.run_id}: checkpoint {name} was not loaded (a bug)")
        return name, self.resume_state

    def _visit(self, i: int) -> Any:
        self.iter_materialize = None
        visit = self.session.iteration_start(i)
        if visit.kind == _native.VisitKind.RESTORE:
            name, state = self._resumed(visit.checkpoint)
            self._apply(state, name)
        elif visit.kind == _native.VisitKind.RERUN:
            # Interrupted in (or after) the steps of iteration i: the code
            # before the steps runs again as it first ran, from the RNG
            # state and the loop's variables it started with (it may create
            # the data iterator and draw its order, or evaluate when the
            # iteration counter says so), but on the objects as the process
            # started them (nanoGPT's estimate_loss() on initial weights):
            # the session marks it stale, and the interrupted run logged its
            # values already.
            _, state = self._resumed(visit.checkpoint)
            if state.get("iter_rng") is not None:
                set_rng_state(state["iter_rng"])
            at_start = (state.get("vars") or {}).get("iter")
            if at_start and self.pos.outer_vars is not None:
                self.pos.outer_vars.restore(at_start)
        return visit

    def _rank_extra(self) -> list[Any]:
        # The fingerprints of a following rank's batches: rank 0 writes them.
        if self.leads:
            return []
        rows, self.batch_rows = self.batch_rows, []
        return rows

    def _add_rank_extra(self, rows: list[Any]) -> None:
        self.batch_rows.extend(rows)

    def _outer_ends(self) -> None:
        last = self.session.outer_end()
        if last is not None:
            # Interrupted after the last iteration: nothing is left to run,
            # but the code after the loop reads the state it ended with.
            name, state = self._resumed(last)
            self._apply(state, name)

    def _iteration_starts(self, i: int) -> None:
        t0 = _own_clock()
        super()._iteration_starts(i)
        self.iter_rng = rng_state() if self.pos.iter_kept else None
        if i == 0:
            self.start_rng = self.iter_rng
        self.own_seconds += _own_clock() - t0

    def _start_unkept(self, i: int) -> None:
        self.session.start_unkept(i)

    def _block_starts(self, i: int, iterable: Iterable[T]) -> tuple[Iterator[T], int] | None:
        block = self.session.block_start(i)
        if block.kind == _native.BlockKind.RESTORE:
            # Interrupted after this block's checkpoint: restore it, skip the steps.
            name, state = self._resumed(block.checkpoint)
            self._apply(state, name)
            return None
        self.block_iterable = iterable
        if block.kind == _native.BlockKind.RESUME_STEPS:
            return self._resume_steps(iterable, block.checkpoint, i, block.step)
        self.block_rng = rng_state()  # before iter(): a DataLoader draws its order here
        it = iter(iterable)
        self.order_tap = dataiter.order_tap(it)
        return it, 0

    def _resume_steps(self, iterable: Any, checkpoint: str | None, i: int, done: int) -> tuple[Iterator[Any], int]:
        """Continue an interrupted block exactly: same data order, no sample repeated or skipped."""
        name, state = self._resumed(checkpoint)
        self._apply(state, name, rng=False)
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
            try:
                self._advance_checked(it, i, done)
            except DivergenceError:
                # Nothing was trained on other data: the run stays
                # interrupted, for a relaunch with the order restored.
                self.interrupted()
                raise
        set_rng_state(state["rng"])
        self.order_tap = dataiter.order_tap(it)
        return it, done

    def _advance_checked(self, it: Iterator[Any], i: int, n: int) -> None:
        """Step over the n batches consumed before the interruption, proving
        they are the recorded ones: by their fingerprints, or by their
        sampler's indices where stepping over loads nothing. Under several
        ranks each rank steps over its own; rank 0 compares every rank's,
        and every rank stops on the first that differs, with the same
        error (one rank raising alone would leave the others waiting in a
        collective)."""
        kind: PrintKind
        if dataiter.skips_loading(it):
            kind, mine = "order", dataiter.skip_orders(it, n)
        else:
            kind, mine = "batch", [batches.digest(next(it)) for _ in range(n)]
        if self.ranks is None:
            first = self._first_unlike_recorded(i, 0, kind, mine)
        else:
            gathered = self.ranks.to_leader((kind, mine))
            first = None
            for rank, (k, digests) in enumerate([(kind, mine), *gathered] if gathered is not None else []):
                first = first or self._first_unlike_recorded(i, rank, k, digests)
            first = self.ranks.from_leader(first)
        if first is not None:
            rank, j, recorded, digest = first
            self.session.resumed_batch(i, j, None if self.ranks is None else rank, recorded, digest)

    def _first_unlike_recorded(
        self, i: int, rank: int, kind: PrintKind, digests: list[str]
    ) -> tuple[int, int, str, str] | None:
        """The first of ``rank``'s resumed batches that the session finds
        unlike the recorded one, as (rank, step, recorded, digest)."""
        if not digests:
            return None
        recorded = self.db.batch_digests(self.run_id, i, rank, kind)
        if not recorded:
            whose = f"rank {rank}'s" if self.ranks is not None else "the"
            print(
                f"hindsight: {whose} batches of {self.pos.outer_name} {i} were recorded without "
                f"{'sampler index ' if kind == 'order' else ''}fingerprints (an older hindsight, or an iterator made "
                "before hindsight was imported): the resumed data order is not checked",
                file=sys.stderr,
                flush=True,
            )
            return None
        for j, digest in enumerate(digests):
            try:
                self.session.resumed_batch(i, j, rank, recorded.get(j), digest)
            except DivergenceError:
                return rank, j, recorded[j], digest
        return None

    def _block_ends(self) -> None:
        self.block_iterable = None
        self.order_tap = None

    def _step_loop(self, i: int, it: Iterator[Any], start: int, entry: list[Any]) -> _native.StepLoop:
        # Each step's fingerprints go to `batch_rows` natively; the boundary
        # is decided natively too, except under several ranks, where it is
        # where they meet (`_step_boundary`).
        return self._new_step_loop(
            i,
            it,
            start,
            entry,
            session=self.session,
            prints="record",
            boundary="session" if self.ranks is None else "run",
            rank=self.rank_index,
            tap=self.order_tap,
        )

    def _flush_buffers(self) -> None:
        super()._flush_buffers()
        if self.batch_rows and self.leads:  # a following rank's go to rank 0
            rows, self.batch_rows = self.batch_rows, []
            for key in sorted({r[:3] for r in rows}):
                rank, kind, i = key
                steps = [(j, d) for *k, j, d in rows if tuple(k) == key]
                self.logs.submit(functools.partial(self.db.record_batches, self.run_id, i, rank, kind, steps))
        if self.iter_rows:
            iters, self.iter_rows = self.iter_rows, []
            for loop, group in itertools.groupby(iters, key=lambda r: r[0]):
                ended = [r for _, r in group]
                self.logs.submit(functools.partial(self.db.record_iterations, self.run_id, loop, ended))

    def _step_boundary(self, i: int, j: int) -> None:
        """Between two training steps: act on a signal or a due safety checkpoint."""
        t0 = _own_clock()
        try:
            act = self.session.step_boundary(i, j, self._sync())
            if act is not None:  # most steps: nothing to do
                self._between_steps(i, j, act)
        finally:
            self.own_seconds += _own_clock() - t0

    def _between_steps(self, i: int, j: int, act: _native.StepAction) -> None:
        if act.prepare:
            # After the first step the optimizer's state exists: pin host
            # memory for the whole state now, in the background, so the
            # first checkpoint does not wait for it.
            state = capture(self.objects, [])
            # What a checkpoint after the steps holds besides: the
            # gradients and the steps' variables (an arena pinned for less
            # sends the excess through blocking copies).
            state["grads"] = capture_grads(self.objects)
            # One the code after the steps reads but no checkpoint can hold
            # is refused now, not when the first block of steps ends.
            if self.pos.block_live and self.pos.block_vars is not None:
                state["vars"] = self.pos.block_vars.capture(
                    self.pos.block_vars.names, _storages(state["objects"]), self.transient
                )
            self.store.prepare(state)
        if act.save is not None:
            self._save_step(i, j, act.save, act.wait)
        if act.exit is not None:
            self._exit_for_signal(act.exit, saved=act.save is not None)

    def _save_step(self, i: int, j: int, name: str, wait: bool) -> None:
        mid = {"block_rng": self.block_rng, "iter_rng": self.iter_rng, "position": [i, j]}
        loader = self.block_iterable
        if _stateful_loader(loader):
            mid["loader_state"] = loader.state_dict()
        # Between two steps may be between two optimizer steps too (gradient
        # accumulation): the gradients so far are part of the state then.
        grads = capture_grads(self.objects)
        if grads is not None:
            mid["grads"] = grads
        self._gather_ranks_values()
        self.flush_logs()
        self._save_now(name, mid, wait=wait)

    def _end_iteration(self, i: int, closing: bool = False) -> None:
        t0 = _own_clock()
        try:
            self._end_iteration_timed(i, closing)
        finally:
            self.own_seconds += _own_clock() - t0

    def _end_iteration_timed(self, i: int, closing: bool) -> None:
        # Left by a `break` or by an exception that may be this rank's
        # alone: the ranks may never meet again, so no collective here.
        apart = closing and self.ranks is not None
        if not apart:
            self._sync()
            self._gather_ranks_values()
        end = self.session.iteration_end(i, closing)
        if self.leads:
            # Buffered, and written behind the values logged so far (the
            # log thread writes in order): a row naming a checkpoint never
            # lands before the values that checkpoint covers (those were
            # written before its save: `_end_block`).
            row = _native.Iteration(
                i,
                time.perf_counter() - self.pos.iter_start,
                value=None if self.pos.outer_value is None else int(self.pos.outer_value),
                checkpoint=end.checkpoint,
                materialize_seconds=self.iter_materialize if end.checkpoint is not None else None,
            )
            self.iter_rows.append((self.pos.outer_name or "", row))
        if end.apply_retention:
            self.flush_logs()
            self.apply_retention()
        if apart or end.save is not None or end.exit is not None:
            self.flush_logs()
        else:
            # Handed to the log thread, not waited for, and only every so
            # often (`logwriter`): the training thread goes on (a write's
            # error surfaces at the next call). The values are durable at
            # every checkpoint, signal and exit; a row naming a checkpoint
            # is handed over at once.
            self.logs.hand(force=end.checkpoint is not None, stage=self._flush_buffers)
            self.logs.check()
        if apart:
            return
        if end.save is not None:
            # After outer iteration i: the next iteration starts afresh on resume.
            self._save_now(end.save, {}, wait=True)
        if end.exit is not None:
            self._exit_for_signal(end.exit, saved=end.save is not None)

    def _exit_for_signal(self, code: int, saved: bool) -> None:
        sig = self.stop_signal
        # Inside an iteration whose start was not kept no checkpoint is
        # taken (core `start_unkept`): the rerun repeats it from the last one.
        fresh = saved or self.pos.iter_kept
        self.interrupted()
        if self.ranks is None:
            _preemption.leave(sig, f"run {self.run_id}", code, requeue=self.requeue, fresh=fresh)
        from hindsight import dist

        dist.leave_job(sig, f"run {self.run_id}", code, requeue=self.requeue, rank=self.ranks.rank, fresh=fresh)

    def interrupted(self) -> None:
        """Logs and checkpoints durable, the run marked `interrupted` (so the
        same command resumes it), before the process leaves for a signal."""
        self.flush_logs()
        if self._store is not None:
            self._store.flush()
        if self.leads:
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

"""The framework seam: one recorder of a framework's fit, shared by the
callbacks that translate a framework's hooks (Lightning's, the Trainer's,
Keras 3's).

A callback tells the recorder what happened (a fit begins, a step or an
epoch ended, a value was logged, a signal arrived) and hands it the
framework's state when asked to save. The recorder owns everything done
with the run session's answers: the store a fit writes to, the resume
walk, the session and its periods, saves, retention, the exit a stop
signal asks for, log flushing, and the replay plan's start. It decides
nothing itself: `runs::session` and `choose_fit` in the engine do."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hindsight import _native, _preemption, _run, session
from hindsight._lightning_store import _check_prefix, latest, project_store
from hindsight._run.ranks import Ranks
from hindsight._state import tensor_bytes
from hindsight._store import Store
from hindsight.errors import HindsightError, InvalidArgumentError, ReplayError


@dataclass(frozen=True)
class SaveOrder:
    """A checkpoint the session asked for: its name, and whether the
    training waits until it is durable (a stop signal's checkpoint does)."""

    name: str
    wait: bool


@dataclass(frozen=True)
class ReplayStart:
    """Where a replay worker's fit starts: the first epoch its plan
    executes, and the checkpoint holding the state before it (None: the
    fit's start)."""

    epoch: int
    checkpoint: str | None


def checked_args(
    owner: str,
    *,
    prefix: str,
    every_n_epochs: int | None,
    every_n_train_steps: int | None,
    keep_last: int | None,
    keep_best: int | None,
    monitor: str | None,
    mode: str,
    keep_every: int | None,
    exit_code: int | None,
) -> tuple[str, Any]:
    """The arguments every framework callback takes (Lightning's, the
    Trainer's, Keras's), checked by one rule: the prefix, and the engine's
    period and retention rules. Returns the prefix and the `Retention`."""
    if not isinstance(prefix, str):
        raise InvalidArgumentError(f"{owner}(prefix={prefix!r}): must be a string")
    try:
        prefix = _check_prefix(prefix)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{owner}(prefix=...): {e}") from None
    for arg, v in (("every_n_epochs", every_n_epochs), ("every_n_train_steps", every_n_train_steps)):
        if v is not None:
            _native.checked_every(owner, arg, v)
    if exit_code is not None and (
        isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 1 <= exit_code <= 255
    ):
        raise InvalidArgumentError(f"{owner}(exit_code={exit_code!r}): must be an int from 1 to 255")
    retention = _native.Retention.checked(owner, "monitor", "mode", keep_last, keep_best, monitor, mode, keep_every)
    return prefix, retention


# The runs a fit was recorded into by this process.
_CLAIMED: set[str] = set()


class FitRecorder:
    """One framework fit, recorded (or replayed) through the process's run.

    `owner` names the callback in every error (``"keras.HindsightCallback"``).
    The arguments are the callbacks' common ones, checked here once.

    `per_run`: a fit's checkpoints are named under the script's run
    (``<prefix>.<run id>``) and found again by it on a relaunch (the
    Trainer's, Keras's). Lightning's are named under the prefix alone
    (``<prefix>[.fitN]``): the user resumes them by `ckpt_path`
    (`HindsightCheckpoint.latest_path(store, prefix)`), knowing no run, and
    a fit records into a run only where the script has one."""

    def __init__(
        self,
        owner: str,
        store: Store | str | os.PathLike[str] | None,
        *,
        prefix: str,
        every_n_epochs: int | None,
        every_n_train_steps: int | None,
        keep_last: int | None,
        keep_best: int | None,
        monitor: str | None,
        mode: str,
        keep_every: int | None,
        exit_code: int | None,
        requeue: bool | None,
        catch_sigint: bool,
        per_run: bool = True,
    ) -> None:
        if store is not None and not isinstance(store, (Store, str, os.PathLike)):
            raise InvalidArgumentError(f"{owner}(store={store!r}): a hindsight.Store, a directory or a store URL")
        self.owner = owner
        self.prefix, self.retention = checked_args(
            owner,
            prefix=prefix,
            every_n_epochs=every_n_epochs,
            every_n_train_steps=every_n_train_steps,
            keep_last=keep_last,
            keep_best=keep_best,
            monitor=monitor,
            mode=mode,
            keep_every=keep_every,
            exit_code=exit_code,
        )
        self._store = store if isinstance(store, Store) else None
        self._store_path = None if store is None or isinstance(store, Store) else os.fspath(store)
        self.every_n_epochs = every_n_epochs
        self.every_n_train_steps = every_n_train_steps
        self.monitor = monitor
        self.exit_code = exit_code
        self.requeue = requeue if requeue is not None else _preemption.requeue_default()
        self.signals = _preemption.StopSignals(catch_sigint)
        self.train_prefix = self.prefix
        self.last_saved: str | None = None
        self.metric: float | None = None
        self.session: Any = None
        self.replay: session.ReplayRun | None = None
        self.exit_pending: int | None = None
        self.epoch_started = 0.0
        self.per_run = per_run
        # A fit over several processes (`join_ranks`): rank 0 writes, every
        # rank stops on a signal any rank got, a waited save is a barrier.
        self.rank_zero = True
        self._ranks: Ranks | None = None
        self._barrier: Callable[[], None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # A framework may copy its callbacks (deepcopy, spawn): the session,
        # the store's handles and the process group are this process's.
        state = self.__dict__.copy()
        state.update(_store=None, session=None, replay=None, _ranks=None, _barrier=None)
        return state

    def join_ranks(self, rank: int, world: int, barrier: Callable[[], None]) -> None:
        """The fit spans `world` processes, this one `rank` (over the
        framework's default process group): they agree as an `hs.loop`
        recording's ranks do (`_run.ranks`)."""
        self.rank_zero = rank == 0
        if world > 1 and self._ranks is None:
            self._ranks = Ranks.of_framework(rank, world, self.owner)
        self._barrier = barrier if world > 1 else None

    # -- the store and the resume walk ---------------------------------------------
    @property
    def store(self) -> Store:
        """The store given, else the one the script's run uses (the project's
        ``.hindsight/store``, or ``$HINDSIGHT_STORE``; in a replay, the
        recorded one). Only a `per_run` fit creates the run to ask (a DDP
        rank other than 0 records none)."""
        if self._store is None:
            if self._store_path is not None:
                self._store = Store(self._store_path)
            else:
                run = _run._RUN
                if run is not None and not run.finished:
                    self._store = run.store
                else:
                    self._store = session.run().store if self.per_run else Store(project_store())
                self._store_path = self._store.path
        return self._store

    @staticmethod
    def run() -> Any:
        """The script's recording (created if none): the fit's values go there."""
        run = session.recording()
        return run if run is not None else session.run()

    def run_prefix(self) -> str:
        """Where this script's run's fits checkpoint: ``<prefix>.<run id>``."""
        return _check_prefix(f"{self.prefix}.{self.run().run_id}")

    def fit_base(self) -> str:
        """The prefix a fresh fit's checkpoints are chosen under (`choose_fit`)."""
        return self.run_prefix() if self.per_run else self.prefix

    def latest(self) -> str | None:
        """The checkpoint a resume restores: the newest of the run's
        unfinished fit, or None (train afresh; always None in a replay)."""
        return latest(self.store, self.run_prefix())

    # -- recording -------------------------------------------------------------------
    def claim_run(self, call: str) -> None:
        """Refuse a second fit recorded into this process's run (`call`
        names it: ``"train()"``, ``"fit()"``): its epochs would log over the
        first one's, and a resume could not tell them apart."""
        run = self.run()
        if run.run_id in _CLAIMED:
            raise InvalidArgumentError(
                f"{self.owner} records one {call} per process: a second {call} would log its values and "
                f"epochs over the first one's in the same run; run the second stage as its own script"
            )
        _CLAIMED.add(run.run_id)

    def begin(
        self, resumed: str | None, global_step: int, epochs: int | None, *, not_resumed_hint: str | None = None
    ) -> None:
        """A fit starts: afresh, or from checkpoint `resumed` (whose fit it
        continues, under the same prefix) at `global_step`. Starting afresh
        while an interrupted fit could be resumed prints `not_resumed_hint`
        (how to resume it, where the framework needs the user's help)."""
        self._note_store()
        if resumed is not None:
            ck = _native.CheckpointId.parse(resumed)
            if ck is None:
                raise HindsightError(f"{self.owner}: {resumed!r} is not a hindsight checkpoint name")
            self.train_prefix = ck.prefix
        elif not self.rank_zero:
            self.train_prefix = self.prefix  # only rank zero writes
        else:
            choice = _native.choose_fit(self.store.list(), self.fit_base())
            if choice.resume is not None and global_step == 0 and not_resumed_hint:
                print(
                    f"hindsight: note: the interrupted fit under {choice.resume.prefix!r} is not resumed: "
                    f"{not_resumed_hint}",
                    file=sys.stderr,
                    flush=True,
                )
            self.train_prefix = choice.fresh_prefix
        sess = _native.RecordSession.for_framework(self.train_prefix, time.monotonic())
        # A resumed fit does not save again the step it starts at.
        sess.set_framework_periods(self.every_n_epochs, self.every_n_train_steps, global_step)
        if self.exit_code is not None:
            sess.set_exit_code(self.exit_code)
        if not self.retention.is_empty():
            sess.set_retention(self.retention)
        sess.outer_start("epoch", epochs)
        self.session = sess
        self.exit_pending = None
        self.metric = None
        self.signals.received = None
        # After the run's own handlers (installed when it was created): ours answer.
        self.signals.install()

    def _note_store(self) -> None:
        """The run the fit records into names the store its checkpoints are
        in: what `hindsight replay` restores from."""
        run = self.run() if self.per_run else session.recording()
        if run is None or not self.rank_zero:
            return
        store = self.store
        if run.recorded_store != store.path:
            run.db.set_store(run.run_id, store.path)
            run.recorded_store = store.path

    def epoch_begin(self, epoch: int) -> None:
        self.epoch_started = time.perf_counter()
        if self.session is not None:
            self.session.iteration_start(epoch)
            self.session.block_start(epoch)

    def _signal_to_session(self) -> None:
        run = session.recording()
        if self.signals.received is None and run is not None and run.stop_signal is not None:
            self.signals.received = run.stop_signal  # the run's handler took it
        if self._ranks is not None:
            # The signal any rank got stops every rank, under its own number.
            (got,) = self._ranks.agree([float(self.signals.received or 0)])
            if got and self.signals.received is None:
                self.signals.received = int(got)
        if self.signals.received is not None:
            self.session.signal(self.signals.received)

    def step_end(self, epoch: int, global_step: int) -> SaveOrder | None:
        """A step ended inside `epoch`: the checkpoint due now, if any (a
        stop signal's exit follows once it is saved)."""
        if self.session is None:
            return None
        self._signal_to_session()
        act = self.session.step_boundary(epoch, global_step, time.monotonic())
        if act is None:
            return None
        if act.exit is not None:
            self.exit_pending = act.exit
        return None if act.save is None else SaveOrder(act.save, act.wait)

    def epoch_end(self, epoch: int) -> SaveOrder | None:
        """`epoch` ended (its values logged): the checkpoint due, if any.
        Then `epoch_done`, before the save is carried out."""
        if self.session is None:
            return None
        self._signal_to_session()
        block = self.session.block_end(epoch, time.perf_counter() - self.epoch_started, None, 0.0)
        return None if block is None else SaveOrder(block.name, block.wait)

    def epoch_done(self, epoch: int, checkpoint: str | None, *, closing: bool = False) -> None:
        """The epoch's row (naming its checkpoint), and the exit a signal asks
        for: pending until the checkpoint is saved (`save`) or, with none
        due, until `leave_if_pending`. `closing`: the fit ends here."""
        if self.session is None:
            return
        run = session.recording()
        if run is not None and self.rank_zero:
            self._note_store()
            run.db.record_iteration(
                run.run_id, "epoch", epoch, time.perf_counter() - self.epoch_started, checkpoint, None, epoch
            )
        code = self.session.iteration_end(epoch, closing).exit
        if code is not None:
            self.exit_pending = code

    def leave_if_pending(self) -> None:
        code, self.exit_pending = self.exit_pending, None
        if code is not None:
            self.leave(code)

    def save(
        self, order: SaveOrder, tree: dict[str, Any], meta: dict[str, object], *, allow_pickle: bool = False
    ) -> None:
        """Write the checkpoint the session asked for (rank zero writes),
        apply retention, and leave if a stop signal asked to (once the
        checkpoint is durable on every rank)."""
        # Every value logged so far reaches the database before the checkpoint that covers it.
        self.flush_logs()
        wait = order.wait or self.exit_pending is not None
        if self.rank_zero:
            if self.monitor and self.metric is not None and meta.get("kind") == "epoch":  # keep_best ranks epochs
                meta = {**meta, "monitor": self.monitor, "metric": repr(self.metric)}
            t0 = time.perf_counter()
            handle = self.store.save(order.name, tree, meta=meta, allow_pickle=allow_pickle)
            if self.session is not None:
                # Priced and sized as an `hs.loop` run's: the budget thins a
                # long fit's checkpoints to a spread (core `checkpoint_size`).
                self.session.saved(time.perf_counter() - t0, time.monotonic())
                self.session.checkpoint_size(tensor_bytes(tree))
            self.last_saved = order.name
            if wait:
                handle.wait()
                self.store.flush()
            self.apply_retention()
        else:
            self.last_saved = order.name
        if wait and self._barrier is not None:
            self._barrier()
        self.leave_if_pending()

    def log(self, ctx: list[tuple[str, int]], values: dict[str, Any]) -> None:
        """The framework's logged numbers, at `ctx` (compared with the
        recorded ones in a replay); the monitored one is kept for keep_best."""
        run = self.run()
        for key, value in values.items():
            if isinstance(value, (bool, str)) or not hasattr(value, "__float__"):
                continue  # a number, a numpy scalar or a 0-d tensor is kept
            run.log_at(ctx, key, float(value))
            if key == self.monitor:
                self.metric = float(value)

    def finish(self, epoch: int, tree: dict[str, Any], meta: dict[str, object]) -> None:
        """The fit completed: its end mark (the next fit starts afresh
        instead of resuming this one), retention, gc."""
        self.signals.restore()
        if self.session is None:
            return
        if not self.rank_zero:
            self.session = None
            session.context(None)
            return
        mark = _native.CheckpointId(self.train_prefix, "epoch", epoch, "end").name
        self.store.save(mark, {"finished": True, **tree}, meta={**meta, "kind": "fit_end"}).wait()
        self.store.flush()
        if self.session.finish("completed").apply_retention:
            self.apply_retention()
        self.store.gc()
        self.session = None
        self.flush_logs()
        session.context(None)

    def apply_retention(self) -> None:
        policy = self.retention if self.session is None else self.session.retention
        if not policy.is_empty():
            self.store.apply_policy(self.train_prefix, policy)

    @staticmethod
    def flush_logs() -> None:
        run = session.recording()
        if run is not None:
            run.flush_logs()

    def leave(self, code: int) -> None:
        """Exit with `code` once the stop signal's checkpoint is durable."""
        self.signals.restore()
        run = session.recording()
        if run is not None:
            run.interrupted()  # the relaunch resumes this run's values
        # One rank requeues and speaks for all.
        _preemption.leave(
            self.signals.received,
            str(self.last_saved),
            code,
            requeue=self.requeue and self.rank_zero,
            announce=self.rank_zero,
        )

    # -- replay: a worker of `hindsight replay` --------------------------------------
    def replay_start(self) -> ReplayStart:
        """The worker's first executed epoch and the checkpoint before it.
        A framework fit restores only before its first executed epoch and
        executes the rest: a later restore in the plan is refused."""
        rs = session.replaying("epoch")
        if rs is None:
            raise ReplayError(
                f"hindsight replay: this worker's plan is not over the epochs {self.owner} records "
                "(the run recorded another loop)"
            )
        self.replay = rs
        sess = rs.session
        sess.set_cost_rule(False)
        sess.outer_start("epoch")
        i = 0
        visit = sess.iteration_start(i)
        while visit.kind == _native.VisitKind.SKIP:
            i += 1
            visit = sess.iteration_start(i)
        if visit.kind == _native.VisitKind.STOP:
            raise ReplayError("hindsight replay: this worker's plan visits no epoch")
        later = sorted(j for j, mode in rs.plan.modes.items() if j > i and mode == "restore")
        if later:
            raise ReplayError(
                f"hindsight replay: the plan restores epoch(s) {later} inside a running fit, which "
                f"{self.owner} cannot do; it replays by executing epochs"
            )
        if visit.kind == _native.VisitKind.RUN_FROM_START:
            return ReplayStart(i, None)
        block = sess.block_start(i, {})
        if block.kind != _native.BlockKind.RESTORE or block.checkpoint is None:
            raise ReplayError(f"hindsight replay: the plan executes epoch {i} without the state before it")
        return ReplayStart(i, block.checkpoint)

    def replay_restored(self, start: ReplayStart, seconds: float) -> None:
        """The checkpoint before `start.epoch` is restored (it took `seconds`)."""
        assert self.replay is not None and start.checkpoint is not None
        rs = self.replay
        rs.session.restored_in(seconds)
        try:
            rs.db.set_restore_seconds(rs.run_id, "epoch", start.epoch, seconds)
        except HindsightError as e:  # bookkeeping only: say so, but never fail a replay for it
            print(f"hindsight: could not record the restore time of {start.checkpoint}: {e}", file=sys.stderr)
        rs.session.block_end(start.epoch, False)
        rs._end_iteration(start.epoch)

    def replay_epoch_begin(self, epoch: int, first: ReplayStart | None) -> None:
        """An executed epoch begins (`first`: the worker's start, already visited)."""
        assert self.replay is not None
        sess = self.replay.session
        if first is None or first.epoch != epoch or first.checkpoint is not None:
            visit = sess.iteration_start(epoch)
            if visit.kind in (_native.VisitKind.SKIP, _native.VisitKind.STOP):
                raise ReplayError(
                    f"hindsight replay: the fit runs epoch {epoch}, which this worker's plan does not visit"
                )
        block = sess.block_start(epoch, {})
        if block.kind == _native.BlockKind.RESTORE:
            raise ReplayError(f"hindsight replay: the plan restores epoch {epoch} inside a running fit")
        session.drop(False)

    def replay_epoch_end(self, epoch: int) -> tuple[str | None, bool]:
        """An executed epoch ended: the checkpoint its state must equal (or
        None), and whether the worker's plan ends here. `replay_progress`
        follows once the epoch's values are all logged."""
        assert self.replay is not None
        sess = self.replay.session
        end = sess.block_end(epoch, False)
        check = end.checkpoint if end.kind == _native.EndKind.CHECK else None
        last = sess.last_needed
        return check, last is not None and epoch >= last

    def replay_progress(self, epoch: int) -> None:
        """`epoch` is done: its values are compared, its progress line printed."""
        assert self.replay is not None
        self.replay._end_iteration(epoch)

    def replay_differs(self, epoch: int, checkpoint: str, what: str, why: str = "the state differs") -> None:
        """Stop the worker: after `epoch`, `what` is not the checkpoint's."""
        assert self.replay is not None
        err = self.replay.session.state_differs(epoch, checkpoint, what, why)
        self.replay._diverged(err)

    def replay_end(self, stopped: bool) -> None:
        assert self.replay is not None
        session.context(None)
        session.drop(False)
        if stopped:
            # The plan ended before the fit did: what the script logs after
            # the fit describes this worker's last epoch, not the run's end.
            last = self.replay.session.last_needed
            self.replay.session.iteration_start((last or 0) + 1)
            self.replay.past_plan = True

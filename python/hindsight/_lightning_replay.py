"""A `hindsight replay` worker's Lightning fit (`HindsightCheckpoint` hands
its hooks here while replaying).

The fit runs epoch 0 up to the last epoch the plan visits. An epoch the
plan restores skips its training (the module's on_train_batch_start
answers -1, Lightning's own way to end an epoch early), loads the epoch's
checkpoint when the epoch ends, runs validation on it and goes on to the
epoch-end hooks, so probes there see the recorded state. An epoch it
executes trains as recorded. Other epochs are skipped with their values
dropped. After the fit, the checkpoint callbacks left out of it come back
with the recording's final states, and an evaluation of the fitted module
is refused where it would not be the recording's."""

from __future__ import annotations

import os
import sys
import time
import weakref
from typing import Any

from hindsight import _native, session
from hindsight._lightning_io import HindsightCheckpointIO
from hindsight._lightning_store import _import_lightning, _unpack
from hindsight._state import set_rng_state
from hindsight.errors import HindsightError, ReplayError

pl = _import_lightning()
# The end mark's key for the other checkpoint callbacks' final states.
CALLBACKS_KEY = "checkpoint_callbacks"
# Where a best/last path a replay cannot know points: loading it is refused, naming why.
_UNKNOWN = os.path.join(os.sep, "hindsight-replay-unknown")


def _drop(on: bool) -> None:
    session.drop(on)


class LightningReplay:
    """One replayed fit, for `owner` (the HindsightCheckpoint: its store,
    state key and options) in the worker's `run`. Its state: the mode of
    the epoch under way (restore, execute, or None: skipped), the
    checkpoint it restores, the visited epoch whose progress line is due,
    the module hook and the callbacks it replaced; after the fit, whether
    the fitted module is the recording's."""

    def __init__(self, owner: Any, run: session.ReplayRun) -> None:
        self.owner = owner
        self.run = run
        # An epoch executed instead of restored could not be compared with
        # the checkpoint it replaces here: keep the plan's restores.
        run.session.set_cost_rule(False)
        self._mode: str | None = None
        self._restoring: str | None = None
        self._pending: int | None = None
        self._hooked: Any = None
        self._dropped: list[Any] = []
        self._fit_module: Any = None
        self._fit_final = True
        self._unknown_state = False
        self._last_visited: int | None = None

    @property
    def executing(self) -> bool:
        """The epoch under way trains (its steps are not skipped)."""
        return self._mode == "execute"

    def train_starts(self, trainer: Any) -> None:
        # The fit ends after the last epoch the plan visits.
        trainer.fit_loop.max_epochs = (self.run.session.last_needed or 0) + 1

    def batch_ends(self, trainer: Any, batch_idx: int) -> None:
        # No fingerprints recorded for Lightning's batches: counted, not compared.
        self.run.session.step(trainer.current_epoch, batch_idx, "")

    def unhook(self, pl_module: Any) -> None:
        if self._hooked is not None:
            vars(pl_module).pop("on_train_batch_start", None)
            self._hooked = None

    def setup(self, trainer: Any) -> None:
        # Replay computes values only: no callback may write checkpoints
        # over the recorded ones or stop the fit early.
        kinds = (pl.callbacks.Checkpoint, pl.callbacks.EarlyStopping)
        dropped = [cb for cb in trainer.callbacks if cb is not self.owner and isinstance(cb, kinds)]
        self._dropped = dropped
        if dropped:
            trainer.callbacks = [cb for cb in trainer.callbacks if cb not in dropped]
            names = ", ".join(sorted({type(cb).__name__ for cb in dropped}))
            print(f"hindsight replay: {names} left out (replay writes no checkpoint)", file=sys.stderr, flush=True)

    def fit_end(self, trainer: Any, pl_module: Any) -> None:
        """After a replayed fit: the callbacks left out of it come back with the
        states the recorded fit ended with, so that `test`/`validate`/`predict(
        ckpt_path="best" | "last")` load the files the recording loaded (checked
        unchanged) and never a model this replay happens to hold."""
        recorded_epochs = [it.idx for it in self.run.db.iterations(self.run.run_id, "epoch")]
        self._fit_module = weakref.ref(pl_module)
        self._fit_final = bool(recorded_epochs) and self._last_visited == max(recorded_epochs)
        self._unknown_state = False
        mark, why = self.recorded_end_mark()
        if mark is not None and not self._fit_final:
            # What follows the fit (test, validate) logs at the recorded fit's
            # end, not at the epoch where this replay could stop.
            loop = trainer.fit_loop
            if isinstance(mark.get("epoch"), int):
                loop.epoch_progress.current.completed = loop.epoch_progress.current.processed = mark["epoch"]
            if isinstance(mark.get("batches_that_stepped"), int):
                loop.epoch_loop._batches_that_stepped = mark["batches_that_stepped"]
        dropped, self._dropped = self._dropped, []
        if not dropped:
            return
        trainer.callbacks = [*trainer.callbacks, *dropped]
        recorded = None if mark is None else mark.get(CALLBACKS_KEY)
        if mark is not None and not isinstance(recorded, dict):
            why = "its end mark was written by a hindsight that did not record the checkpoint callbacks"
            recorded = None
        io = trainer.strategy.checkpoint_io
        files: dict[str, list[int]] = {}
        dirs: list[str] = []
        unknown: dict[str, str] = {}
        for cb in dropped:
            if not isinstance(cb, pl.callbacks.Checkpoint):
                continue
            rec = None if recorded is None else recorded.get(str(cb.state_key))
            if rec is None:
                reason = why or (
                    f"the recording's end of fit holds no state of {type(cb).__name__} {cb.state_key} "
                    "(a state that cannot be stored without pickling, or another callback configuration)"
                )
                marker = os.path.join(_UNKNOWN, str(len(unknown)), "unknown.ckpt")
                self._unknown_state = True
                unknown[marker] = (
                    f'replay cannot tell which file the recording\'s ckpt_path="best"/"last" named: {reason}'
                )
                for attr in ("best_model_path", "last_model_path", "dirpath"):
                    if hasattr(cb, attr):
                        setattr(cb, attr, marker if attr != "dirpath" else os.path.dirname(marker))
                continue
            state = dict(rec["state"])
            if hasattr(cb, "dirpath") and "dirpath" in state:
                cb.dirpath = state["dirpath"]
            cb.load_state_dict(state)
            if isinstance(state.get("dirpath"), str):
                dirs.append(state["dirpath"])
            files.update({str(k): [int(x) for x in v] for k, v in (rec.get("files") or {}).items()})
        if isinstance(io, HindsightCheckpointIO):
            io.recorded_files = {os.path.normpath(k): v for k, v in files.items()}
            io.recorded_dirs = dirs
            io.unknown = unknown

    def recorded_end_mark(self) -> tuple[dict[str, Any] | None, str | None]:
        """The recorded fit's end mark, or (None, why not)."""
        names = [it.checkpoint for it in self.run.db.iterations(self.run.run_id, "epoch") if it.checkpoint]
        ck = _native.CheckpointId.parse(names[-1]) if names else None
        if ck is None:
            return None, "the recorded fit has no hindsight checkpoint to find its end from"
        ends = [c for c in self.owner.store.checkpoints(ck.prefix) if c.prefix == ck.prefix and c.kind == "end"]
        if not ends:
            return None, f"the recorded fit ({ck.prefix}) has no end mark in {self.owner.store.path}: it did not finish"
        return self.owner.store.load(ends[-1].name), None

    def hook_module(self, pl_module: Any) -> None:
        original = pl_module.on_train_batch_start

        def on_train_batch_start(batch: Any, batch_idx: int) -> Any:
            answer = original(batch, batch_idx)
            return answer if self._mode == "execute" else -1

        pl_module.on_train_batch_start = on_train_batch_start
        self._hooked = original

    def progress(self) -> None:
        """The visited epoch's values compared and its progress line printed,
        once Lightning has finished it."""
        if self._pending is not None:
            self.run._end_iteration(self._pending)
            self._pending = None

    def epoch_starts(self, trainer: Any) -> None:
        self.progress()
        epoch = trainer.current_epoch
        session = self.run.session
        visit = session.iteration_start(epoch)
        self._mode = self._restoring = None
        if visit.kind not in (_native.VisitKind.SKIP, _native.VisitKind.STOP):
            block = session.block_start(epoch, {})
            self._mode = "restore" if block.kind == _native.BlockKind.RESTORE else "execute"
            self._restoring = block.checkpoint
        # The epoch starts from the state the previous one left only where the
        # plan visited that one (or at the fit's start): the session says stale.
        _drop(self._mode is None or visit.stale)

    def epoch_ends(self, trainer: Any) -> None:
        epoch = trainer.current_epoch
        name = self._restoring
        if self._mode == "restore" and name is not None:
            t0 = time.perf_counter()
            ckpt = _unpack(self.owner.store.load(name, allow_pickle=self.owner.allow_pickle))
            _restore_epoch_end(trainer, ckpt, name)
            took = time.perf_counter() - t0
            self.run.session.restored_in(took)
            try:
                self.run.db.set_restore_seconds(self.run.run_id, "epoch", epoch, took)
            except HindsightError as e:  # bookkeeping only: say so, but never fail a replay for it
                print(f"hindsight: could not record the restore time of {name}: {e}", file=sys.stderr)
            _drop(False)
            _validate(trainer)
            # Validation drew from the random generators after the recorded
            # epoch's did: put back the checkpoint's for what follows.
            rng = (ckpt.get("callbacks") or {}).get(self.owner.state_key, {}).get("rng")
            if self.owner.restore_rng and rng:
                set_rng_state(rng)
        if self._mode is not None:
            self._pending = epoch
            self._last_visited = epoch

    def check_evaluated_model(self, trainer: Any, pl_module: Any) -> None:
        """In a replay, `test`/`validate`/`predict` after the fit without a
        checkpoint file evaluate the module as the replayed fit left it: that
        is the recording's only where the replay reached its last epoch."""
        fitted = self._fit_module() if self._fit_module is not None else None
        if fitted is None or fitted is not pl_module or getattr(trainer, "ckpt_path", None) is not None:
            return
        if not self._fit_final:
            raise ReplayError(
                "the script evaluates the fitted model after fit, but this replay's fit stopped before the "
                "recording's last epoch (it needed no later one), so the model is not the one the recording "
                'evaluated; replay without --where, or evaluate a checkpoint (ckpt_path="best")'
            )
        if self._unknown_state:
            raise ReplayError(
                "the script evaluates after fit without a checkpoint file, and the recording's end of fit holds "
                "no state of its checkpoint callback: replay cannot tell whether the recording's evaluation "
                'loaded a file (ckpt_path="last") or the fitted model'
            )


def _restore_epoch_end(trainer: Any, ckpt: dict[str, Any], name: str) -> None:
    """The state `ckpt` (taken at an epoch's end) in the running fit, through
    Lightning's own restore of the model, precision plugin, callbacks,
    optimizers and schedulers; the loop's counters (global step, steps for
    logging) are set from it, the fit loop's position is not (the epoch is
    the same)."""
    # Only the states of callbacks this fit has (replay leaves some out).
    present = {cb.state_key for cb in trainer.callbacks}
    ckpt = {**ckpt, "callbacks": {k: v for k, v in (ckpt.get("callbacks") or {}).items() if k in present}}
    connector = trainer._checkpoint_connector
    connector._loaded_checkpoint = ckpt
    try:
        connector.restore_model()
        connector.restore_precision_plugin_state()
        connector.restore_callbacks()
        connector.restore_optimizers_and_schedulers()
    finally:
        connector._loaded_checkpoint = {}
    loops = ckpt.get("loops", {}).get("fit_loop", {})
    epoch_loop = trainer.fit_loop.epoch_loop
    for key, progress in (
        ("epoch_loop.batch_progress", epoch_loop.batch_progress),
        ("epoch_loop.scheduler_progress", epoch_loop.scheduler_progress),
        ("epoch_loop.automatic_optimization.optim_progress", epoch_loop.automatic_optimization.optim_progress),
        ("epoch_loop.manual_optimization.optim_step_progress", epoch_loop.manual_optimization.optim_step_progress),
    ):
        if key in loops:
            progress.load_state_dict(loops[key])
    stepped = loops.get("epoch_loop.state_dict", {}).get("_batches_that_stepped")
    if stepped is not None:
        epoch_loop._batches_that_stepped = stepped
    if trainer.global_step != ckpt.get("global_step"):
        raise ReplayError(
            f"restoring {name}: the global step is {trainer.global_step}, the checkpoint's "
            f"{ckpt.get('global_step')} (this Lightning version, {pl.__version__}, keeps its counters elsewhere)"
        )


def _validate(trainer: Any) -> None:
    """The validation Lightning runs at the end of a training epoch, for an
    epoch whose training a replay skipped."""
    epoch_loop = trainer.fit_loop.epoch_loop
    due = getattr(epoch_loop, "_should_check_val_epoch", None)
    if not trainer.enable_validation or (callable(due) and not due()):
        return
    first = trainer._logger_connector._first_loop_iter
    # Lightning validates after the epoch's last step and before it counts
    # that step for logging: its values are logged at the step before.
    stepped = epoch_loop._batches_that_stepped
    epoch_loop._batches_that_stepped = max(0, stepped - 1)
    trainer.validating = True
    try:
        epoch_loop.val_loop.run()
    finally:
        epoch_loop._batches_that_stepped = stepped
    trainer.training = True
    trainer._logger_connector._first_loop_iter = first

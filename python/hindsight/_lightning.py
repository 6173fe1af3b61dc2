"""The Lightning classes of `hindsight.lightning`, in a module of their own
because defining them imports Lightning: `hindsight.lightning` loads this
module on first use of `HindsightCheckpoint` or `HindsightCheckpointIO`."""

from __future__ import annotations

import importlib
import os
import sys
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

from hindsight import _fit, _native, _preemption, _run, session
from hindsight._lightning_store import (
    DEFAULT_PREFIX,
    _import_lightning,
    _map_location,
    _name_of,
    _pack,
    _unpack,
    _unsupported,
    checkpoints,
    latest,
    latest_path,
)
from hindsight._state import rng_state, set_rng_state
from hindsight._store import Store
from hindsight.errors import HindsightError, ReplayError, UnsupportedTypeError

pl = _import_lightning()
# The end mark's key for the other checkpoint callbacks' final states.
_CALLBACKS_KEY = "checkpoint_callbacks"
# Where a best/last path a replay cannot know points: loading it is refused, naming why.
_UNKNOWN = os.path.join(os.sep, "hindsight-replay-unknown")
_io = importlib.import_module(pl.__name__ + ".plugins")
CheckpointIO = _io.CheckpointIO
TorchCheckpointIO = _io.TorchCheckpointIO


class HindsightCheckpointIO(CheckpointIO):  # type: ignore[misc, valid-type]
    """A Lightning ``CheckpointIO`` for ``hindsight://<name>`` paths.

    ``save_checkpoint`` snapshots into the store and returns while the
    write continues (``store.flush()`` or ``teardown`` waits);
    ``load_checkpoint`` verifies every byte; ``remove_checkpoint`` removes
    the manifest (``store.gc()`` reclaims space). Any other path goes to
    ``fallback`` (default ``TorchCheckpointIO``), so ``ModelCheckpoint``
    files keep working. Use as ``Trainer(plugins=[HindsightCheckpointIO(store)])``;
    :class:`HindsightCheckpoint` installs one by itself.
    """

    def __init__(
        self, store: Store | str | os.PathLike[str], *, fallback: Any = None, allow_pickle: bool = False
    ) -> None:
        super().__init__()
        self._store = store if isinstance(store, Store) else None
        self._store_path = store.path if isinstance(store, Store) else os.fspath(store)
        self.fallback = fallback
        self.allow_pickle = allow_pickle
        # In a replay worker after its fit: the files the recording's
        # checkpoint callbacks named (best, last), as they were when its fit
        # ended ([size, mtime_ns]), and why a path they would have named is unknown.
        self.recorded_files: dict[str, list[int]] | None = None
        self.recorded_dirs: list[str] = []
        self.unknown: dict[str, str] = {}

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = Store(self._store_path)
        return self._store

    def _fallback(self) -> Any:
        if self.fallback is None:
            self.fallback = TorchCheckpointIO()
        return self.fallback

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        name = _name_of(path)
        if name is None:
            self._fallback().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        meta = storage_options if isinstance(storage_options, Mapping) else None
        self.store.save(name, _pack(checkpoint), meta=meta, allow_pickle=self.allow_pickle)
        return None

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None, **kwargs: Any
    ) -> dict[str, Any]:
        name = _name_of(path)
        if name is None:
            self._check_recorded(path)
            if weights_only is not None:
                kwargs["weights_only"] = weights_only
            loaded: dict[str, Any] = self._fallback().load_checkpoint(path, map_location=map_location, **kwargs)
            return loaded
        # weights_only: a hindsight checkpoint never runs code when loaded
        # unless allow_pickle=True was chosen for this store.
        return _unpack(self.store.load(name, map_location=_map_location(map_location), allow_pickle=self.allow_pickle))

    def _check_recorded(self, path: Any) -> None:
        """In a replay: a `ckpt_path="best"`/`"last"` file is the one the
        recording's evaluation loaded, unchanged since its fit ended, or the load is refused."""
        if self.recorded_files is None:
            return
        key = os.fspath(path)
        if os.path.normpath(key) in self.unknown:
            raise ReplayError(self.unknown[os.path.normpath(key)])
        want = self.recorded_files.get(os.path.normpath(key))
        if want is None:
            real = os.path.realpath(key)
            inside = [
                d for d in self.recorded_dirs if os.path.commonpath([real, os.path.realpath(d)]) == os.path.realpath(d)
            ]
            if inside:
                raise ReplayError(
                    f"{key} is in {inside[0]}, where the recording's ModelCheckpoint wrote, but was not among "
                    "its files when the recorded fit ended: replay cannot evaluate the model the recording did"
                )
            return  # a path the script names itself
        try:
            st = os.stat(key)
        except OSError as e:
            raise ReplayError(
                f"the recording evaluated {key}, which its ModelCheckpoint wrote; it cannot be read now ({e}), "
                "so replay cannot evaluate the same model"
            ) from None
        if [st.st_size, st.st_mtime_ns] != list(want):
            raise ReplayError(
                f"the recording evaluated {key}, which its ModelCheckpoint wrote; the file was changed since "
                "the recorded fit ended (size or modification time differ), so replay cannot evaluate the same model"
            )

    def remove_checkpoint(self, path: Any) -> None:
        name = _name_of(path)
        if name is None:
            self._fallback().remove_checkpoint(path)
            return
        self.store.remove(name)
        return None

    def teardown(self) -> None:
        if self._store is not None and self._store._pid == os.getpid():
            self._store.flush()
        if self.fallback is not None:
            self.fallback.teardown()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_store"] = None  # reopened from the path in a spawned process
        return state


class HindsightCheckpoint(pl.Callback):  # type: ignore[misc, name-defined]
    """Checkpoint ``Trainer.fit`` into a hindsight store; stop cleanly on
    preemption signals; keep what the retention policy says.

    See the module documentation (``help(hindsight.lightning)``).
    """

    def __init__(
        self,
        store: Store | str | os.PathLike[str] | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        every_n_epochs: int | None = 1,
        every_n_train_steps: int | None = None,
        keep_last: int | None = None,
        keep_best: int | None = None,
        monitor: str | None = None,
        mode: str = "min",
        keep_every: int | None = None,
        exit_code: int | None = None,
        requeue: bool | None = None,
        catch_sigint: bool = False,
        allow_pickle: bool = False,
        restore_rng: bool = True,
    ) -> None:
        super().__init__()
        # The fit's recording: the arguments every framework callback takes,
        # checked by one rule; the store, the session (`runs::session`: when
        # to save, what a stop signal does, retention), saves, the ranks'
        # agreement and the exit (`_fit`, the framework seam).
        self.rec = _fit.FitRecorder(
            "HindsightCheckpoint",
            store,
            prefix=prefix,
            every_n_epochs=every_n_epochs,
            every_n_train_steps=every_n_train_steps,
            keep_last=keep_last,
            keep_best=keep_best,
            monitor=monitor,
            mode=mode,
            keep_every=keep_every,
            exit_code=exit_code,
            requeue=requeue,
            catch_sigint=catch_sigint,
            per_run=False,
        )
        self.allow_pickle = allow_pickle
        self.restore_rng = restore_rng
        # A checkpoint was saved before Lightning handed the step's or epoch's
        # values to the loggers: they go to the database at the next hook.
        self._flush_due = False
        # Set in setup: a restored fit that recorded into a hindsight run
        # continues that run (load_state_dict).
        self._continue_run = False
        # In a `hindsight replay` worker: its run, the mode of the epoch under
        # way, the visited epoch whose progress line is due, the module hook
        # replaced for the fit.
        self._replay: session.ReplayRun | None = None
        self._mode: str | None = None
        self._restoring: str | None = None
        self._pending: int | None = None
        self._hooked: Any = None
        self._dropped: list[Any] = []
        # After a replayed fit: whether the fitted module holds the recorded
        # final weights (the fit reached the recording's last epoch), and
        # whether a checkpoint callback's recorded state was unknown.
        self._fit_module: Any = None
        self._fit_final = True
        self._unknown_state = False
        self._last_visited: int | None = None

    # -- plumbing ----------------------------------------------------------------
    # The arguments, as given (checked by the recorder).
    prefix = property(lambda self: self.rec.prefix)
    retention = property(lambda self: self.rec.retention)
    every_n_epochs = property(lambda self: self.rec.every_n_epochs)
    every_n_train_steps = property(lambda self: self.rec.every_n_train_steps)
    monitor = property(lambda self: self.rec.monitor)
    exit_code = property(lambda self: self.rec.exit_code)
    requeue = property(lambda self: self.rec.requeue)

    @property
    def store(self) -> Store:
        """The store given, else the project's, where the script's hindsight
        run keeps its checkpoints (LightningCLI's `--trainer.callbacks+=...`
        gives none); no run is created to ask."""
        return self.rec.store

    @property
    def fit_prefix(self) -> str:
        """Where this fit writes: `prefix`, or `<prefix>.fitN` for a later
        fresh fit in the same store (decided when fit starts)."""
        return self.rec.train_prefix

    @property
    def last_saved(self) -> str | None:
        return self.rec.last_saved

    @property
    def state_key(self) -> str:
        return str(self._generate_state_key(prefix=self.prefix))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_replay"] = state["_hooked"] = None
        return state

    latest = staticmethod(latest)
    latest_path = staticmethod(latest_path)
    checkpoints = staticmethod(checkpoints)

    def resume_path(self, *, verify: bool = False) -> str | None:
        """``hindsight://<newest checkpoint of this callback's store and prefix>``, or None."""
        return latest_path(self.store, self.prefix, verify=verify)

    # -- signals -------------------------------------------------------------------
    @property
    def stop_signal(self) -> int | None:
        return self.rec.signals.received

    @stop_signal.setter
    def stop_signal(self, signum: int | None) -> None:
        self.rec.signals.received = signum

    def _fix_lightning_teardown(self, trainer: Any) -> None:
        # Lightning's teardown puts back the handlers it found when fit
        # started, ours among them; make it put back the ones we replaced.
        found = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", None)
        if isinstance(found, dict):
            for sig, handler in list(found.items()):
                if handler == self.rec.signals.handler:
                    found[sig] = self.rec.signals.put_back(sig)

    def _restore_signals(self, trainer: Any = None) -> None:
        self._fix_lightning_teardown(trainer)
        self.rec.signals.restore()

    def _flush_logs(self) -> None:
        """The values of the script's hindsight run (HindsightLogger, hs.log in
        the hooks) so far into its log database."""
        self._flush_due = False
        self.rec.flush_logs()

    def _leave_if_pending(self, trainer: Any) -> None:
        """Leave, if a stop signal asked to, with Lightning's teardown taught
        to put back the handlers we replaced."""
        if self.rec.exit_pending is not None:
            self._fix_lightning_teardown(trainer)
            self.rec.leave_if_pending()

    # -- saving -----------------------------------------------------------------------
    def _save(self, trainer: Any, order: _fit.SaveOrder, end: bool) -> None:
        """Every rank dumps the checkpoint (a strategy may gather state);
        the recorder writes rank zero's and leaves if a signal asked to."""
        # Lightning hands the loggers this step's (or epoch's) own values
        # after this hook: they go to the database at the next flush.
        self._flush_due = True
        if self.rec.exit_pending is not None:
            self._fix_lightning_teardown(trainer)
        epoch = trainer.current_epoch
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        meta: dict[str, object] = {
            "lightning": pl.__version__,
            "epoch": epoch,
            "global_step": trainer.global_step,
            "kind": "epoch" if end else "step",
        }
        self.rec.metric = self._metric(trainer) if end and trainer.is_global_zero else None
        try:
            self.rec.save(
                order, _pack(checkpoint) if trainer.is_global_zero else {}, meta, allow_pickle=self.allow_pickle
            )
        except UnsupportedTypeError as e:
            raise UnsupportedTypeError(
                f"{e}. HindsightCheckpoint stores the Lightning checkpoint without pickling; make this "
                "value a plain type, or pass HindsightCheckpoint(..., allow_pickle=True) if the store is "
                "trusted (loading then unpickles it)"
            ) from e

    def _metric(self, trainer: Any) -> float | None:
        if not self.monitor:
            return None
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            if self.retention.keep_best is not None and not getattr(self, "_warned_monitor", False):
                self._warned_monitor = True
                warnings.warn(
                    f"HindsightCheckpoint: monitor {self.monitor!r} is not among the logged metrics "
                    f"at epoch end ({sorted(trainer.callback_metrics)}); keep_best ignores those epochs",
                    stacklevel=2,
                )
            return None
        try:
            return float(value)
        except (TypeError, ValueError):
            return None

    # -- Lightning hooks -------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._replay = session.replaying("epoch") if stage == "fit" else None
        if self._replay is not None:
            # An epoch executed instead of restored could not be compared
            # with the checkpoint it replaces here: keep the plan's restores.
            self._replay.session.set_cost_rule(False)
            self._replay_setup(trainer)
        self._continue_run = stage == "fit" and self._replay is None and bool(trainer.is_global_zero)
        if self._continue_run:
            _config_over_own(trainer)
        # Teach the strategy's CheckpointIO hindsight:// paths before
        # Lightning restores from ckpt_path.
        strategy = trainer.strategy
        io = strategy.checkpoint_io
        if not isinstance(io, HindsightCheckpointIO):
            strategy.checkpoint_io = HindsightCheckpointIO(self.store, fallback=io, allow_pickle=self.allow_pickle)
        elif self.allow_pickle and not io.allow_pickle and io.store.path == self.store.path:
            io.allow_pickle = True

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self._replay is not None:
            self._hook_module(pl_module)
            return
        if not self.allow_pickle:
            for owner, obj in (("LightningModule", pl_module), ("LightningDataModule", trainer.datamodule)):
                hparams = getattr(obj, "hparams", None) if obj is not None else None
                if hparams:
                    bad = _unsupported(dict(hparams), "hyper_parameters")
                    if bad:
                        raise UnsupportedTypeError(
                            f"HindsightCheckpoint: the {owner}'s hyper-parameter at {bad} cannot be stored "
                            "without pickling; save plain values (str, int, float, bool, None, lists, dicts, "
                            "tensors) with save_hyperparameters, or pass HindsightCheckpoint(..., "
                            "allow_pickle=True) if the store is trusted (loading then unpickles it)"
                        )
        self.rec.join_ranks(int(trainer.global_rank), int(trainer.world_size), self._barrier(trainer))
        # A fit resumed from one of our checkpoints continues under its
        # prefix; any other fit starts a new one, so that it never mixes its
        # checkpoints with (or is later resumed as) an earlier fit's.
        resumed = _name_of(getattr(trainer, "ckpt_path", None))
        if resumed and _native.CheckpointId.parse(resumed) is None:
            resumed = None
        epochs = trainer.max_epochs
        self.rec.begin(resumed, trainer.global_step, epochs if epochs is not None and epochs > 0 else None)
        self._flush_due = False

    @staticmethod
    def _barrier(trainer: Any) -> Any:
        return lambda: trainer.strategy.barrier("hindsight_checkpoint")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._replay is not None:
            # The fit ends after the last epoch the plan visits.
            trainer.fit_loop.max_epochs = (self._replay.session.last_needed or 0) + 1
            return
        # Lightning registered its own SIGTERM handler after on_fit_start
        # (composed with ours); it would stop with exit status 0 and no
        # checkpoint. Take SIGTERM back for the duration of fit.
        self.rec.signals.install()
        self._fix_lightning_teardown(trainer)
        # A fit resumed mid-epoch does not call on_train_epoch_start.
        self.rec.epoch_started = time.perf_counter()

    # hs.log in the module's hooks: the (epoch, global step) Lightning is at.
    def _context(self, ctx: list[tuple[str, int]] | None) -> None:
        session.context(ctx)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._flush_due:
            self._flush_logs()  # the values of the step a checkpoint was taken after
        self._context([("epoch", trainer.current_epoch), ("step", trainer.global_step)])
        if self._replay is not None and self._mode != "execute":
            _drop(True)  # a skipped step: until the checkpoint is restored, no value is the epoch's

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._context([("epoch", trainer.current_epoch)])
        _restart_eval_steps(trainer)
        if getattr(trainer.state.fn, "value", None) != "fit":  # trainer.validate(), not fit's validation
            self._check_evaluated_model(trainer, pl_module)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._context([("epoch", trainer.current_epoch)])
        _restart_eval_steps(trainer)
        self._check_evaluated_model(trainer, pl_module)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._check_evaluated_model(trainer, pl_module)

    def _check_evaluated_model(self, trainer: Any, pl_module: Any) -> None:
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

    # The sanity check's validation is no epoch's: its values are dropped
    # (as Lightning drops its self.log values).
    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        _drop(True)

    def on_sanity_check_end(self, trainer: Any, pl_module: Any) -> None:
        _drop(False)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._end_of_epoch(trainer)
        self._context([("epoch", trainer.current_epoch)])
        if self._replay is not None:
            self._replay_epoch_starts(trainer)
        else:
            # Lightning restores a fit itself (ckpt_path): every epoch runs.
            self.rec.epoch_begin(trainer.current_epoch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._context([("epoch", trainer.current_epoch)])
        if self._replay is not None:
            # No fingerprints recorded for Lightning's batches: counted, not compared.
            self._replay.session.step(trainer.current_epoch, batch_idx, "")
            return
        epoch_loop = trainer.fit_loop.epoch_loop
        should_accumulate = getattr(epoch_loop, "_should_accumulate", None)
        if callable(should_accumulate) and should_accumulate():
            return  # mid gradient accumulation: not a step boundary
        if epoch_loop.batch_progress.is_last_batch:
            # A signal after an epoch's last step is acted on at the epoch's
            # end (on_train_epoch_end). Lightning resumes a checkpoint taken
            # here at the next epoch: this epoch's validation and end hooks
            # would never run, and a stateful loader would get the finished
            # epoch's position for the next one (which then yields nothing).
            return
        order = self.rec.step_end(trainer.current_epoch, trainer.global_step)
        if self.rec.exit_pending is not None:
            self._log_step_metrics(trainer)
        if order is not None:
            self._save(trainer, order, end=False)
        self._leave_if_pending(trainer)

    @staticmethod
    def _log_step_metrics(trainer: Any) -> None:
        """Hand this step's `self.log` values to the loggers before leaving
        mid-epoch: the loop does it only after the batch-end hooks, and the
        resumed fit starts at the next step, so they would be lost."""
        connector: Any = getattr(trainer, "_logger_connector", None)
        if hasattr(connector, "on_batch_end") and hasattr(connector, "update_train_step_metrics"):
            connector.on_batch_end()
            connector.update_train_step_metrics()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._context([("epoch", trainer.current_epoch)])
        if self._replay is not None:
            self._replay_epoch_ends(trainer)
            return
        epoch = trainer.current_epoch
        order = self.rec.epoch_end(epoch)
        if order is not None:
            self._save(trainer, order, end=True)
        # The epoch as an iteration of the script's hindsight run (when it
        # has one: `HindsightLogger`, `hs.*`), with its checkpoint: what
        # `hindsight replay` plans from. On a signal, leave once Lightning
        # has finished the epoch (the module's on_train_epoch_end, the
        # epoch's self.log values): the resumed fit starts at the next epoch
        # and would not run them.
        self.rec.epoch_done(epoch, None if order is None else order.name)

    def _end_of_epoch(self, trainer: Any) -> None:
        """After Lightning finished an epoch (the next epoch's start, or the
        end of training): its last values, logged after the epoch-end
        checkpoint, into the database; then the exit a signal asked for."""
        if self._replay is not None:
            return
        self._flush_logs()
        self._leave_if_pending(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._replay is not None:
            self._replay_progress()
        self._end_of_epoch(trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self._replay is not None:
            self._replay_fit_end(trainer, pl_module)
            return  # a replay writes no checkpoint and no mark
        # The mark of a finished fit: `latest_path` then starts the next fit
        # afresh instead of restoring this one (and training nothing). It
        # holds the other checkpoint callbacks' final states: what a
        # replay's `test(ckpt_path="best")` must load.
        self._fix_lightning_teardown(trainer)
        tree: dict[str, Any] = {}
        if trainer.is_global_zero:
            tree = {
                "global_step": trainer.global_step,
                "batches_that_stepped": trainer.fit_loop.epoch_loop._batches_that_stepped,
                _CALLBACKS_KEY: self._checkpoint_callback_states(trainer),
            }
        epoch = trainer.current_epoch
        self.rec.finish(epoch, {"epoch": epoch, **tree}, {"lightning": pl.__version__})

    def _checkpoint_callback_states(self, trainer: Any) -> dict[str, Any]:
        """{state key: {"state": its state_dict, "files": {path: [size, mtime_ns]}}}
        of the fit's other checkpoint callbacks (ModelCheckpoint), where the
        store holds the state without pickling."""
        out: dict[str, Any] = {}
        for cb in trainer.checkpoint_callbacks:
            if cb is self:
                continue
            state = cb.state_dict()
            if _unsupported(state, "state") is not None:
                continue  # a replay refuses its best/last, naming it
            files: dict[str, list[int]] = {}
            paths = [getattr(cb, "best_model_path", None), getattr(cb, "last_model_path", None)]
            paths += list(getattr(cb, "best_k_models", None) or {})
            dirpath = getattr(cb, "dirpath", None)
            if isinstance(dirpath, str) and os.path.isdir(dirpath):
                paths += [os.path.join(dirpath, f) for f in os.listdir(dirpath)]
            for path in paths:
                if isinstance(path, str) and path and os.path.isfile(path):
                    st = os.stat(path)
                    files[os.path.normpath(path)] = [st.st_size, st.st_mtime_ns]
            out[str(cb.state_key)] = {"state": state, "files": files}
        return out

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._restore_signals(trainer)
        # A signal before on_train_start reached Lightning's handler too,
        # which stops with SystemExit(None) (status 0): nothing was trained
        # since the last checkpoint, but the batch system must reschedule.
        if self.stop_signal is not None and isinstance(exception, SystemExit) and not exception.code:
            exception.code = _preemption.exit_code(self.rec.exit_code)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._context(None)
        _drop(False)
        if self._hooked is not None:
            vars(pl_module).pop("on_train_batch_start", None)
            self._hooked = None
        self._restore_signals(trainer)

    # -- replay: a worker of `hindsight replay` --------------------------------------------
    # The fit runs epoch 0 up to the last epoch the plan visits. An epoch the
    # plan restores skips its training (the module's on_train_batch_start
    # answers -1, Lightning's own way to end an epoch early), loads the
    # epoch's checkpoint when the epoch ends, runs validation on it and goes
    # on to the epoch-end hooks, so probes there see the recorded state. An
    # epoch it executes trains as recorded. Other epochs are skipped with
    # their values dropped.
    def _replay_setup(self, trainer: Any) -> None:
        # Replay computes values only: no callback may write checkpoints
        # over the recorded ones or stop the fit early.
        kinds = (pl.callbacks.Checkpoint, pl.callbacks.EarlyStopping)
        dropped = [cb for cb in trainer.callbacks if cb is not self and isinstance(cb, kinds)]
        self._dropped = dropped
        if dropped:
            trainer.callbacks = [cb for cb in trainer.callbacks if cb not in dropped]
            names = ", ".join(sorted({type(cb).__name__ for cb in dropped}))
            print(f"hindsight replay: {names} left out (replay writes no checkpoint)", file=sys.stderr, flush=True)

    def _replay_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """After a replayed fit: the callbacks left out of it come back with the
        states the recorded fit ended with, so that `test`/`validate`/`predict(
        ckpt_path="best" | "last")` load the files the recording loaded (checked
        unchanged) and never a model this replay happens to hold."""
        assert self._replay is not None
        recorded_epochs = [it.idx for it in self._replay.db.iterations(self._replay.run_id, "epoch")]
        self._fit_module = weakref.ref(pl_module)
        self._fit_final = bool(recorded_epochs) and self._last_visited == max(recorded_epochs)
        self._unknown_state = False
        mark, why = self._recorded_end_mark()
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
        recorded = None if mark is None else mark.get(_CALLBACKS_KEY)
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

    def _recorded_end_mark(self) -> tuple[dict[str, Any] | None, str | None]:
        """The recorded fit's end mark, or (None, why not)."""
        assert self._replay is not None
        names = [it.checkpoint for it in self._replay.db.iterations(self._replay.run_id, "epoch") if it.checkpoint]
        ck = _native.CheckpointId.parse(names[-1]) if names else None
        if ck is None:
            return None, "the recorded fit has no hindsight checkpoint to find its end from"
        ends = [c for c in self.store.checkpoints(ck.prefix) if c.prefix == ck.prefix and c.kind == "end"]
        if not ends:
            return None, f"the recorded fit ({ck.prefix}) has no end mark in {self.store.path}: it did not finish"
        return self.store.load(ends[-1].name), None

    def _hook_module(self, pl_module: Any) -> None:
        original = pl_module.on_train_batch_start

        def on_train_batch_start(batch: Any, batch_idx: int) -> Any:
            answer = original(batch, batch_idx)
            return answer if self._mode == "execute" else -1

        pl_module.on_train_batch_start = on_train_batch_start
        self._hooked = original

    def _replay_progress(self) -> None:
        if self._pending is not None and self._replay is not None:
            self._replay._end_iteration(self._pending)
            self._pending = None

    def _replay_epoch_starts(self, trainer: Any) -> None:
        assert self._replay is not None
        self._replay_progress()
        epoch = trainer.current_epoch
        session = self._replay.session
        visit = session.iteration_start(epoch)
        self._mode = self._restoring = None
        if visit.kind not in (_native.VisitKind.SKIP, _native.VisitKind.STOP):
            block = session.block_start(epoch, {})
            self._mode = "restore" if block.kind == _native.BlockKind.RESTORE else "execute"
            self._restoring = block.checkpoint
        # The epoch starts from the state the previous one left only where the
        # plan visited that one (or at the fit's start): the session says stale.
        _drop(self._mode is None or visit.stale)

    def _replay_epoch_ends(self, trainer: Any) -> None:
        assert self._replay is not None
        epoch = trainer.current_epoch
        name = self._restoring
        if self._mode == "restore" and name is not None:
            t0 = time.perf_counter()
            ckpt = _unpack(self.store.load(name, allow_pickle=self.allow_pickle))
            _restore_epoch_end(trainer, ckpt, name)
            took = time.perf_counter() - t0
            self._replay.session.restored_in(took)
            try:
                self._replay.db.set_restore_seconds(self._replay.run_id, "epoch", epoch, took)
            except HindsightError as e:  # bookkeeping only: say so, but never fail a replay for it
                print(f"hindsight: could not record the restore time of {name}: {e}", file=sys.stderr)
            _drop(False)
            _validate(trainer)
            # Validation drew from the random generators after the recorded
            # epoch's did: put back the checkpoint's for what follows.
            rng = (ckpt.get("callbacks") or {}).get(self.state_key, {}).get("rng")
            if self.restore_rng and rng:
                set_rng_state(rng)
        if self._mode is not None:
            self._pending = epoch
            self._last_visited = epoch

    def state_dict(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix,
            "rng": _loadable_rng(rng_state()) if self.restore_rng else None,
            "run": session.recording() is not None,  # the fit records into a hindsight run
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rng = state_dict.get("rng")
        if self.restore_rng and rng:
            set_rng_state(rng)
        if state_dict.get("run") and self._continue_run:
            # Continue the interrupted run now, not at the first hs.log: a
            # relaunch with nothing left to train logs nothing, and the run
            # would stay "interrupted" although the fit completed.
            session.run()


def _loadable_rng(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with NumPy's key array as a list of ints: Lightning writes this
    callback state into every `.ckpt` (ModelCheckpoint's too), and torch's
    weights-only loading (`trainer.test(ckpt_path="best")`) refuses a NumPy
    array. `set_rng_state` takes either form."""
    np_state = state.get("numpy")
    if np_state is not None:
        name, key, pos, has_gauss, cached = np_state
        state = {**state, "numpy": [str(name), [int(k) for k in key], int(pos), int(has_gauss), float(cached)]}
    return state


def _config_over_own(trainer: Any) -> None:
    """A relaunch that continues the run (same script, same arguments) lets
    LightningCLI's SaveConfigCallback write the run's config.yaml over the one
    the run's first process wrote in the HindsightLogger's directory: by
    default it refuses to overwrite, and the relaunch after a preemption
    would fail."""
    logger = trainer.loggers[0] if trainer.loggers else None
    if not isinstance(logger, HindsightLogger) or not logger._own_dir:
        return  # not the run's directory (a directory of the user's: their files)
    if not getattr(logger.record, "continued", False):  # the run, created now if it was not
        return
    for cb in trainer.callbacks:
        if type(cb).__name__ == "SaveConfigCallback" and hasattr(cb, "overwrite"):
            cb.overwrite = True


def _restart_eval_steps(trainer: Any) -> None:
    """Lightning logs an evaluation step's values at a count of the process's
    evaluation batches (sanity check and earlier validations included), which a
    resumed fit or a replay that skips epochs counts differently: counted from
    0 in each validation or test run instead, the (epoch, step) a value is
    recorded at is the same in every process."""
    loop = getattr(trainer, "_active_loop", None)
    seen = getattr(loop, "_seen_batches_per_dataloader", None)
    if seen is not None:
        seen.clear()


def _drop(on: bool) -> None:
    session.drop(on)


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


_loggers = importlib.import_module(pl.__name__ + ".loggers")
_rank_zero_only = importlib.import_module(pl.__name__ + ".utilities").rank_zero_only


class HindsightLogger(_loggers.Logger):  # type: ignore[misc, name-defined]
    """``self.log`` values into the script's hindsight run, at (epoch, global
    step): ``Trainer(logger=HindsightLogger())`` (beside other loggers too).
    The run is the one ``hs.*`` calls record into (created here if the script
    made none), so ``hs.dataframe``, ``hindsight logs`` and ``hindsight plot``
    read Lightning's metrics beside ``hs.log`` values."""

    def __init__(self, save_dir: str | None = None) -> None:
        super().__init__()
        self._record: Any = None
        self._save_dir = None if save_dir is None else os.fspath(save_dir)
        self._own_dir = save_dir is None  # the run's directory, not one of the user's

    @property
    def record(self) -> Any:
        """The hindsight run the values go to (created on first use)."""
        if self._record is None:
            self._record = session.run()
        return self._record

    @property
    def name(self) -> str:
        return "hindsight"

    @property
    def save_dir(self) -> str:
        """Where Lightning writes this run's files: LightningCLI's
        ``config.yaml`` (``trainer.log_dir`` is a logger's ``save_dir``) and,
        without a ``dirpath``, ``ModelCheckpoint``'s files (in
        ``<save_dir>/hindsight/<run id>/checkpoints``). Default: the run's
        directory in the project home, ``<home>/lightning/<run id>``. A replay
        worker writes into a directory of its own working directory (removed
        with it), never over the recording's files."""
        if isinstance(self.record, session.ReplayRun):
            return os.path.join(os.getcwd(), ".hindsight-replay-lightning")
        if self._save_dir is None:
            self._save_dir = str(self.record.home / "lightning" / self.record.run_id)
        return self._save_dir

    @property
    def log_dir(self) -> str:
        return self.save_dir

    @property
    def version(self) -> str:
        return str(self.record.run_id)

    @_rank_zero_only  # type: ignore[untyped-decorator]
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        params = dict(params) if params is not None and not isinstance(params, dict) else params or {}
        if isinstance(self.record, session.RecordRun) and params:
            self.record.add_args(params, "hyper-parameter")

    @_rank_zero_only  # type: ignore[untyped-decorator]
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        epoch = metrics.get("epoch")
        if epoch is None:
            # An evaluation step's values come without the epoch: the one
            # HindsightCheckpoint says the evaluation runs in (its step is the
            # batch's place in this validation or test run).
            epoch = next((i for k, i in _run.framework_context() or [] if k == "epoch"), None)
        ctx = [("epoch", int(epoch))] if epoch is not None else []
        if step is not None:
            ctx.append(("step", int(step)))
        for name, value in metrics.items():
            if name != "epoch":
                self.record.log_at(ctx, name, float(value))

    @_rank_zero_only  # type: ignore[untyped-decorator]
    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        # A checkpoint another callback (ModelCheckpoint) wrote: the values
        # it covers reach the database now, not at the end of fit.
        if self._record is not None:
            self._record.flush_logs()

    @_rank_zero_only  # type: ignore[untyped-decorator]
    def finalize(self, status: str) -> None:
        self.record.flush_logs()

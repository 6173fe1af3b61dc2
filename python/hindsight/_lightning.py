"""The Lightning classes of `hindsight.lightning`, in a module of their own
because defining them imports Lightning: `hindsight.lightning` loads this
module on first use of `HindsightCheckpoint` or `HindsightCheckpointIO`."""

from __future__ import annotations

import importlib
import os
import time
import warnings
from collections.abc import Mapping
from typing import Any

from hindsight import _fit, _native, _preemption, _run, session
from hindsight._lightning_io import HindsightCheckpointIO
from hindsight._lightning_replay import CALLBACKS_KEY, LightningReplay, _drop
from hindsight._lightning_store import (
    DEFAULT_PREFIX,
    _import_lightning,
    _name_of,
    _pack,
    _unsupported,
    checkpoints,
    latest,
    latest_path,
)
from hindsight._state import rng_state, set_rng_state
from hindsight._store import Store
from hindsight.errors import UnsupportedTypeError

pl = _import_lightning()


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
        # In a `hindsight replay` worker: the fit being replayed; after it,
        # the replayed fit (what an evaluation of its module may assume).
        self._replay: LightningReplay | None = None
        self._replayed: LightningReplay | None = None

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
        state["_replay"] = state["_replayed"] = None
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
        run = session.replaying("epoch") if stage == "fit" else None
        self._replay = None if run is None else LightningReplay(self, run)
        if self._replay is not None:
            self._replayed = None
            self._replay.setup(trainer)
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
            self._replay.hook_module(pl_module)
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
            self._replay.train_starts(trainer)
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
        if self._replay is not None and not self._replay.executing:
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
        if self._replayed is not None:
            self._replayed.check_evaluated_model(trainer, pl_module)

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
            self._replay.epoch_starts(trainer)
        else:
            # Lightning restores a fit itself (ckpt_path): every epoch runs.
            self.rec.epoch_begin(trainer.current_epoch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._context([("epoch", trainer.current_epoch)])
        if self._replay is not None:
            self._replay.batch_ends(trainer, batch_idx)
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
            self._replay.epoch_ends(trainer)
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
            self._replay.progress()
        self._end_of_epoch(trainer)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self._replay is not None:
            self._replay.fit_end(trainer, pl_module)
            self._replayed = self._replay
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
                CALLBACKS_KEY: self._checkpoint_callback_states(trainer),
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
        if self._replay is not None:
            self._replay.unhook(pl_module)
        self._restore_signals(trainer)

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

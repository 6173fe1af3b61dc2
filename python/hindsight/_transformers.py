"""The Trainer callback of `hindsight.transformers`, in a module of its own
because defining it imports transformers.

The callback translates Trainer's events into the run session's
(`runs::session` in the engine: when to save, what a stop signal does,
retention) and carries out the answers. A save is Trainer's own
`_save_checkpoint`, asked for through `control.should_save`: Trainer then
writes it after the step's logging and evaluation, at the point its own
checkpoints are taken (the RNG states after an evaluation drew from them,
the log history with the step's values), and `on_save` moves the files
into the store."""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hindsight import _native, _preemption, _settings, session
from hindsight._lightning_store import _check_prefix, latest
from hindsight._store import Store
from hindsight.errors import HindsightError, InvalidArgumentError, NotFoundError, ReplayError

DEFAULT_PREFIX = "transformers"
_TENSORS = ".safetensors"
# Keys of Trainer's logs that are clock readings (eval_runtime, train_samples_per_second, ...).
_TIMINGS = ("_runtime", "_per_second")
# train()'s closing train_loss: the mean over the steps of that call, which
# a resume changes (the per-step loss values hold the run's).
_PER_CALL = frozenset({"train_loss"})


def _pack_dir(root: Path) -> list[dict[str, Any]]:
    """The files of a Trainer checkpoint directory, as the store keeps them:
    safetensors files as their tensors (deduplicated by the store), every
    other file as its bytes (Trainer reads them back itself)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    files: list[dict[str, Any]] = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel.endswith(_TENSORS):
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
            files.append({"path": rel, "tensors": load_file(str(path)), "metadata": dict(metadata)})
        else:
            files.append({"path": rel, "data": path.read_bytes()})
    return files


def _unpack_dir(files: list[dict[str, Any]], root: Path) -> None:
    from safetensors.torch import save_file

    for entry in files:
        rel = str(entry["path"])
        dest = (root / rel).resolve()
        if root.resolve() not in dest.parents:
            raise HindsightError(f"checkpoint file {rel!r} would be written outside {root}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if "tensors" in entry:
            save_file(entry["tensors"], str(dest), metadata=entry.get("metadata") or None)
        else:
            dest.write_bytes(entry["data"])


# The run whose train() this process recorded: a second one is refused.
_RECORDED: str | None = None


def _last_epoch(state: Any) -> int:
    """The epoch of the step Trainer's state is at: the one it trains next
    mid-epoch, the one it finished at an epoch's end (resumed there, the
    values of train()'s end belong to it, as in the uninterrupted run)."""
    if not state.global_step or not state.epoch:
        return 0
    return max(0, math.ceil(float(state.epoch)) - 1)


class HindsightCallback(transformers.TrainerCallback):
    """Record ``Trainer.train`` in the script's hindsight run, checkpoint it
    into a hindsight store, stop cleanly on preemption signals and resume
    exactly. See the module documentation (``help(hindsight.transformers)``)."""

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
    ) -> None:
        super().__init__()
        if store is not None and not isinstance(store, (Store, str, os.PathLike)):
            raise InvalidArgumentError(
                f"HindsightCallback(store={store!r}): a hindsight.Store, a directory or an s3:// URL"
            )
        if not isinstance(prefix, str):
            raise InvalidArgumentError(f"HindsightCallback(prefix={prefix!r}): must be a string")
        try:
            self.prefix = _check_prefix(prefix)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"HindsightCallback(prefix=...): {e}") from None
        for arg, v in (("every_n_epochs", every_n_epochs), ("every_n_train_steps", every_n_train_steps)):
            if v is not None:
                _native.checked_every("HindsightCallback", arg, v)
        if exit_code is not None and (not isinstance(exit_code, int) or not 1 <= exit_code <= 255):
            raise InvalidArgumentError(f"HindsightCallback(exit_code={exit_code!r}): must be an int from 1 to 255")
        # The retention arguments are checked by the engine's one rule.
        self.retention = _native.Retention.checked(
            "HindsightCallback", "monitor", "mode", keep_last, keep_best, monitor, mode, keep_every
        )
        self._store = store if isinstance(store, Store) else None
        self._store_path = None if store is None or isinstance(store, Store) else os.fspath(store)
        self.every_n_epochs = every_n_epochs
        self.every_n_train_steps = every_n_train_steps
        self.monitor = monitor
        self.exit_code = exit_code
        self.requeue = requeue if requeue is not None else _preemption.requeue_default()
        self._signals = _preemption.StopSignals(catch_sigint)
        self.last_saved: str | None = None
        self.train_prefix = self.prefix
        self._session: Any = None
        self._epoch = 0
        self._epoch_start = 0.0
        # The save asked of Trainer (name, wait, whether its directory is
        # ours to remove), carried out in on_save.
        self._want: tuple[str, bool, bool] | None = None
        # The exit a signal asked for, once the checkpoint is durable.
        self._exit_pending: int | None = None
        # resume_from_checkpoint(): the checkpoint written back, its directory.
        self._resumed: tuple[str, int] | None = None
        self._resume_dir: str | None = None
        self._metric: float | None = None
        # In a `hindsight replay` worker: its run, the epoch its session has
        # started, the executed epoch whose progress line is due, and
        # whether training was stopped before its natural end.
        self._replay: session.ReplayRun | None = None
        self._visited: int | None = None
        self._pending: int | None = None
        self._stopped = False
        self._training = False

    # -- plumbing ----------------------------------------------------------------
    @property
    def store(self) -> Store:
        """The store given, else the one the script's run uses (the project's
        ``.hindsight/store``, or ``$HINDSIGHT_STORE``)."""
        if self._store is None:
            if self._store_path is not None:
                self._store = Store(self._store_path)
            else:
                store: Store = session.run().store
                self._store = store
        return self._store

    @property
    def stop_signal(self) -> int | None:
        return self._signals.received

    def _run(self) -> Any:
        """The script's recording (created if none): Trainer's values go there."""
        run = session.recording()
        return run if run is not None else session.run()

    def _context(self, step: int | None) -> None:
        session.context([("epoch", self._epoch)] + ([] if step is None else [("step", step)]))

    # -- resume --------------------------------------------------------------------
    def run_prefix(self) -> str:
        """Where the checkpoints of this script's run go: ``<prefix>.<run id>``.
        A relaunch that continues the run (same script and arguments, see
        ``hindsight runs``) resumes them; another script, or the same one
        with other arguments, is another run and never resumes them."""
        return _check_prefix(f"{self.prefix}.{self._run().run_id}")

    def latest(self) -> str | None:
        """Name of the checkpoint ``resume_from_checkpoint`` would restore, or None."""
        return latest(self.store, self.run_prefix())

    def resume_from_checkpoint(self) -> str | None:
        """For ``trainer.train(resume_from_checkpoint=...)``: a directory in
        Trainer's layout holding the newest checkpoint of this run's
        unfinished ``train()`` (``run_prefix()``), or None (train afresh).
        The directory is removed once training has restored it."""
        if _settings.text(_settings.REPLAY):
            return self._replay_start()
        self._run()  # a relaunch continues the interrupted run's values
        name = self.latest()
        if name is None:
            return None
        return self._materialize(name)

    def _materialize(self, name: str) -> str:
        """Checkpoint `name` written back as a Trainer checkpoint directory."""
        state = self.store.load(name)
        files = state.get("files")
        if not isinstance(files, list):
            raise HindsightError(
                f"checkpoint {name} holds no Trainer checkpoint (was it written by HindsightCallback?)"
            )
        self._cleanup()
        step = int(state["global_step"])
        self._resume_dir = tempfile.mkdtemp(prefix="hindsight-trainer-")
        target = Path(self._resume_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        target.mkdir()
        _unpack_dir(files, target)
        self._resumed = (name, step)
        if self._replay is None:
            print(f"hindsight: resuming Trainer from {name} (global step {step})", flush=True)
        return str(target)

    def _cleanup(self) -> None:
        if self._resume_dir is not None:
            shutil.rmtree(self._resume_dir, ignore_errors=True)
            self._resume_dir = None

    # -- Trainer events ---------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._training = True
        if _settings.text(_settings.REPLAY):
            if self._replay is None and self._replay_start() is not None:
                raise ReplayError(
                    "hindsight replay: this worker starts from a checkpoint, but train() was not given "
                    "resume_from_checkpoint=callback.resume_from_checkpoint()"
                )
            self._epoch = _last_epoch(state)
            return
        run = self._run()
        global _RECORDED
        if _RECORDED == run.run_id:
            raise InvalidArgumentError(
                "HindsightCallback records one train() per process: a second train() would log its values "
                "and epochs over the first one's in the same run; run the second stage as its own script"
            )
        _RECORDED = run.run_id
        if args.world_size > 1:
            raise InvalidArgumentError(
                f"HindsightCallback: training in {args.world_size} processes is not supported yet "
                "(one process writes the store; the stop decision is not shared)"
            )
        if args.save_only_model:
            raise InvalidArgumentError(
                "HindsightCallback: TrainingArguments(save_only_model=True) leaves the optimizer, scheduler "
                "and RNG states out of Trainer's checkpoints, so a resume could not be exact; use save_only_model=False"
            )
        if args.ignore_data_skip:
            raise InvalidArgumentError(
                "HindsightCallback: TrainingArguments(ignore_data_skip=True) makes a resumed train() start its "
                "epoch from the first batch again, training on other data than the interrupted run; use "
                "ignore_data_skip=False"
            )
        if args.save_strategy == "best":
            raise InvalidArgumentError(
                "HindsightCallback: TrainingArguments(save_strategy='best') decides at each evaluation whether "
                "Trainer writes a checkpoint, and declines the ones hindsight asks for (preemption, epoch ends); "
                "use save_strategy='no', 'steps' or 'epoch'"
            )
        if state.is_hyper_param_search:
            raise InvalidArgumentError(
                "HindsightCallback: hyper-parameter search (trainer.hyperparameter_search) is not supported"
            )
        store = self.store
        if run.recorded_store != store.path:
            run.db.set_store(run.run_id, store.path)
            run.recorded_store = store.path
        resumed = self._resumed
        if resumed is not None and resumed[1] == state.global_step and state.global_step > 0:
            ck = _native.CheckpointId.parse(resumed[0])
            assert ck is not None, resumed[0]
            self.train_prefix = ck.prefix
        else:
            choice = _native.choose_fit(store.list(), self.run_prefix())
            if choice.resume is not None and state.global_step == 0:
                print(
                    f"hindsight: note: the interrupted train() under {choice.resume.prefix!r} is not resumed: "
                    "pass trainer.train(resume_from_checkpoint=callback.resume_from_checkpoint())",
                    file=sys.stderr,
                    flush=True,
                )
            self.train_prefix = choice.fresh_prefix
        self._resumed = None
        sess = _native.RecordSession.for_framework(self.train_prefix, time.monotonic())
        # A resumed train() does not save again the step it starts at.
        sess.set_framework_periods(self.every_n_epochs, self.every_n_train_steps, state.global_step)
        if self.exit_code is not None:
            sess.set_exit_code(self.exit_code)
        if not self.retention.is_empty():
            sess.set_retention(self.retention)
        epochs = state.num_train_epochs
        sess.outer_start("epoch", int(epochs) if epochs and args.max_steps <= 0 else None)
        self._session = sess
        self._want = None
        self._exit_pending = None
        self._metric = None
        self._epoch = _last_epoch(state)
        self._epoch_start = time.perf_counter()
        self._signals.received = None
        # After the run's own handlers (installed when it was created): ours answer.
        self._signals.install()

    def _check_saved(self) -> None:
        if self._want is not None:
            name, self._want = self._want[0], None
            raise HindsightError(
                f"HindsightCallback: Trainer did not write the checkpoint {name} it was asked for "
                "(another callback set control.should_save to False after HindsightCallback)"
            )

    def _between_steps(self) -> None:
        """Trainer has finished the previous step's (or epoch's) logging,
        evaluation and saves: a save asked for was carried out, an exit is due."""
        self._check_saved()
        self._flush_logs()
        code, self._exit_pending = self._exit_pending, None
        if code is not None:
            self._exit(code)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._between_steps()
        self._epoch = math.floor(state.epoch or 0)
        self._epoch_start = time.perf_counter()
        self._context(state.global_step)
        if self._replay is not None:
            self._replay_epoch_starts()
        elif self._session is not None:
            # Trainer restores a train() itself: every epoch runs.
            self._session.iteration_start(self._epoch)
            self._session.block_start(self._epoch)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._between_steps()
        self._cleanup()  # Trainer has read the resumed checkpoint (its RNG states last)
        # Values logged during the step carry its number, as Trainer's loss does.
        self._context(state.global_step + 1)

    def _signal_to_session(self) -> None:
        run = session.recording()
        if self.stop_signal is None and run is not None and run.stop_signal is not None:
            self._signals.received = run.stop_signal  # the run's handler took it
        if self.stop_signal is not None:
            self._session.signal(self.stop_signal)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._context(state.global_step)
        if self._replay is not None:
            # No fingerprints recorded for Trainer's batches: counted, not compared.
            self._replay.session.step(self._epoch, state.global_step, "")
            return
        if self._session is None:
            return
        if state.epoch is not None and state.epoch >= self._epoch + 1:
            return  # the epoch's last step: its end decides (Trainer resumes a checkpoint here at the next epoch)
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            return  # training ends with this step: the epoch's end decides
        self._signal_to_session()
        act = self._session.step_boundary(self._epoch, state.global_step, time.monotonic())
        if act.save is not None:
            self._ask_save(args, state, control, act.save, act.wait)
        if act.exit is not None:
            self._exit_pending = act.exit

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._context(state.global_step)
        if self._replay is not None:
            self._replay_epoch_ends(state, control, kwargs.get("model"))
            return
        if self._session is None:
            return
        self._signal_to_session()
        block = self._session.block_end(self._epoch, time.perf_counter() - self._epoch_start, None, 0.0)
        if block is not None:
            self._ask_save(args, state, control, block.name, block.wait)
        self._record_epoch(None if block is None else block.name)
        # Training that max_steps ends inside an epoch closes here: Trainer,
        # resumed from this point, would train one step more than max_steps
        # (it resumes the epoch's loop and checks max_steps after a step), so
        # a signal now lets it finish instead of exiting.
        ends_mid_epoch = 0 < state.max_steps <= state.global_step and state.epoch < self._epoch + 1
        self._exit_pending = self._session.iteration_end(self._epoch, ends_mid_epoch).exit

    def _ask_save(self, args: Any, state: Any, control: Any, name: str, wait: bool) -> None:
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        # Trainer's own save_strategy may want this checkpoint too (decided
        # before us, by its DefaultFlowCallback): then it stays where it is.
        # A checkpoint pushed to the Hub is uploaded from its directory in the background: it stays too.
        ours = not control.should_save and not folder.exists() and not args.push_to_hub
        control.should_save = True
        self._want = (name, wait, ours)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._want is None:
            return  # Trainer's own checkpoint
        name, wait, ours = self._want
        self._want = None
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not folder.is_dir():
            raise NotFoundError(f"HindsightCallback: Trainer's checkpoint {folder} is missing after its save")
        # Every value logged so far reaches the database before the checkpoint that covers it.
        self._flush_logs()
        meta: dict[str, object] = {
            "transformers": transformers.__version__,
            "epoch": self._epoch,
            "global_step": state.global_step,
            "kind": "step" if getattr(_native.CheckpointId.parse(name), "kind", None) == "step" else "epoch",
        }
        if self.monitor and self._metric is not None and meta["kind"] == "epoch":  # keep_best ranks epochs
            meta["monitor"] = self.monitor
            meta["metric"] = repr(self._metric)
        tree = {"files": _pack_dir(folder), "global_step": state.global_step, "epoch": state.epoch}
        handle = self.store.save(name, tree, meta=meta)
        self.last_saved = name
        if wait or self._exit_pending is not None:
            handle.wait()
            self.store.flush()
        if ours:
            shutil.rmtree(folder, ignore_errors=True)
        self._apply_retention()
        code, self._exit_pending = self._exit_pending, None
        if code is not None:
            self._exit(code)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not logs or not state.is_world_process_zero:
            return
        if self._replay is not None and ("train_runtime" in logs or self._replay.past_plan):
            return  # train()'s closing summary: it covers the recorded train() calls, not this worker's
        run = self._run()
        # Values logged outside train() (a trainer.evaluate() after it) are
        # the script's, at its top level, as hs.log after a loop.
        ctx = [("epoch", self._epoch), ("step", state.global_step)] if self._training else []
        for key, value in logs.items():
            if key == "epoch" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key.endswith(_TIMINGS) or key in _PER_CALL:
                continue  # no resume or replay computes them again
            run.log_at(ctx, key, float(value))
            if key == self.monitor:
                self._metric = float(value)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._training = False
        self._between_steps()
        self._cleanup()
        if self._replay is not None:
            self._replay_ends()
            return
        if self._session is None:
            return
        # The mark of a finished train(): resume_from_checkpoint then starts
        # the next one afresh instead of restoring this one.
        mark = _native.CheckpointId(self.train_prefix, "epoch", self._epoch, "end").name
        self.store.save(
            mark,
            {"finished": True, "epoch": self._epoch, "global_step": state.global_step},
            meta={"transformers": transformers.__version__, "kind": "fit_end"},
        ).wait()
        self.store.flush()
        if self._session.finish("completed").apply_retention:
            self._apply_retention()
        self.store.gc()
        self._session = None
        self._flush_logs()
        session.context(None)
        self._signals.restore()

    # -- replay: a worker of `hindsight replay` --------------------------------------------
    # Trainer cannot skip an epoch's training, but it resumes from its own
    # checkpoints: a worker starts train() from the checkpoint its plan
    # restores before the first epoch it executes (or afresh at epoch 0),
    # executes its epochs, where every value Trainer logs is compared with
    # the recorded one and the weights at each checkpointed epoch end with
    # the checkpoint, and stops after the last epoch the plan needs.
    def _replay_start(self) -> str | None:
        rs = session.replaying("epoch")
        if rs is None:
            raise ReplayError(
                "hindsight replay: this worker's plan is not over the epochs HindsightCallback records "
                "(the run recorded another loop)"
            )
        self._replay = rs
        sess = rs.session
        # An epoch is restored only before the first one executed (train()
        # starts from it): never executed instead.
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
                f"hindsight replay: the plan restores epoch(s) {later} inside a running train(), which Trainer "
                "cannot do; HindsightCallback replays by executing epochs: put the new hs.log in a Trainer "
                "callback, compute_metrics or compute_loss"
            )
        self._visited = i
        if visit.kind == _native.VisitKind.RUN_FROM_START:
            return None  # train() from the start executes epoch 0
        block = sess.block_start(i, {})
        if block.kind != _native.BlockKind.RESTORE or block.checkpoint is None:
            raise ReplayError(f"hindsight replay: the plan executes epoch {i} without the state before it")
        t0 = time.perf_counter()
        path = self._materialize(block.checkpoint)
        took = time.perf_counter() - t0
        sess.restored_in(took)
        try:
            rs.db.set_restore_seconds(rs.run_id, "epoch", i, took)
        except HindsightError as e:  # bookkeeping only: say so, but never fail a replay for it
            print(f"hindsight: could not record the restore time of {block.checkpoint}: {e}", file=sys.stderr)
        sess.block_end(i, False)
        rs._end_iteration(i)
        self._visited = None
        return path

    def _replay_progress(self) -> None:
        if self._pending is not None and self._replay is not None:
            pending, self._pending = self._pending, None
            self._replay._end_iteration(pending)

    def _replay_epoch_starts(self) -> None:
        assert self._replay is not None
        self._replay_progress()
        sess = self._replay.session
        epoch = self._epoch
        if self._visited != epoch:
            visit = sess.iteration_start(epoch)
            if visit.kind in (_native.VisitKind.SKIP, _native.VisitKind.STOP):
                raise ReplayError(
                    f"hindsight replay: Trainer runs epoch {epoch}, which this worker's plan does not visit"
                )
        self._visited = None
        block = sess.block_start(epoch, {})
        if block.kind == _native.BlockKind.RESTORE:
            raise ReplayError(f"hindsight replay: the plan restores epoch {epoch} inside a running train()")
        session.drop(False)

    def _replay_epoch_ends(self, state: Any, control: Any, model: Any) -> None:
        assert self._replay is not None
        sess = self._replay.session
        epoch = self._epoch
        end = sess.block_end(epoch, False)
        if end.kind == _native.EndKind.CHECK and end.checkpoint is not None and model is not None:
            self._check_weights(epoch, end.checkpoint, model)
        self._pending = epoch  # its progress line once Trainer has evaluated it
        last = sess.last_needed
        if last is not None and epoch >= last and not control.should_training_stop:
            control.should_training_stop = True
            self._stopped = True

    def _check_weights(self, epoch: int, name: str, model: Any) -> None:
        """Stop unless the weights this worker trained are the checkpoint's."""
        import torch

        assert self._replay is not None
        live = model.state_dict()
        compared = 0
        for entry in self.store.load(name)["files"]:
            for key, want in (entry.get("tensors") or {}).items():
                have = live.get(key)
                if have is None:
                    continue
                compared += 1
                if not torch.equal(have.detach().cpu(), want):
                    err = self._replay.session.state_differs(
                        epoch, name, f"{entry['path']}/{key}", "the weights differ"
                    )
                    self._replay._diverged(err)
        if not compared:
            print(f"hindsight: note: no weight of {name} matched the model's names; not compared", file=sys.stderr)

    def _replay_ends(self) -> None:
        assert self._replay is not None
        self._replay_progress()
        session.context(None)
        session.drop(False)
        if self._stopped:
            # The plan ended before training did: what the script logs after
            # train() describes this worker's last epoch, not the run's end.
            last = self._replay.session.last_needed
            self._replay.session.iteration_start((last or 0) + 1)
            self._replay.past_plan = True

    # -- helpers ---------------------------------------------------------------------
    def _flush_logs(self) -> None:
        run = session.recording()
        if run is not None:
            run.flush_logs()

    def _record_epoch(self, checkpoint: str | None) -> None:
        run = session.recording()
        if run is None:
            return
        run.db.record_iteration(
            run.run_id, "epoch", self._epoch, time.perf_counter() - self._epoch_start, checkpoint, None, self._epoch
        )

    def _apply_retention(self) -> None:
        policy = self.retention if self._session is None else self._session.retention
        if policy.is_empty():
            return
        self.store.apply_policy(self.train_prefix, policy)

    def _exit(self, code: int) -> None:
        self._signals.restore()
        self._cleanup()
        run = session.recording()
        if run is not None:
            run.interrupted()  # the relaunch resumes this run's values
        _preemption.leave(self.stop_signal, str(self.last_saved), code, requeue=self.requeue)

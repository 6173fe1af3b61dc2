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

from hindsight import _fit, _native, _settings, session
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
        # Everything done with the session's answers; the arguments are checked there.
        self.rec = _fit.FitRecorder(
            "HindsightCallback",
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
        )
        self._epoch = 0
        # The save asked of Trainer (and whether its directory is ours to
        # remove), carried out in on_save.
        self._want: tuple[_fit.SaveOrder, bool] | None = None
        # resume_from_checkpoint(): the checkpoint written back, its directory.
        self._resumed: tuple[str, int] | None = None
        self._resume_dir: str | None = None
        # In a `hindsight replay` worker: its run, the epoch its session has
        # started, the executed epoch whose progress line is due, and
        # whether training was stopped before its natural end.
        self._start: _fit.ReplayStart | None = None
        self._pending: int | None = None
        self._stopped = False
        self._training = False

    # -- plumbing ----------------------------------------------------------------
    @property
    def store(self) -> Store:
        """The store given, else the one the script's run uses (the project's
        ``.hindsight/store``, or ``$HINDSIGHT_STORE``)."""
        return self.rec.store

    @property
    def stop_signal(self) -> int | None:
        return self.rec.signals.received

    @property
    def last_saved(self) -> str | None:
        return self.rec.last_saved

    @property
    def _replay(self) -> session.ReplayRun | None:
        return self.rec.replay

    @property
    def _session(self) -> Any:
        return self.rec.session

    def _context(self, step: int | None) -> None:
        session.context([("epoch", self._epoch)] + ([] if step is None else [("step", step)]))

    # -- resume --------------------------------------------------------------------
    def run_prefix(self) -> str:
        """Where the checkpoints of this script's run go: ``<prefix>.<run id>``.
        A relaunch that continues the run (same script and arguments, see
        ``hindsight runs``) resumes them; another script, or the same one
        with other arguments, is another run and never resumes them."""
        return self.rec.run_prefix()

    def latest(self) -> str | None:
        """Name of the checkpoint ``resume_from_checkpoint`` would restore, or None."""
        return self.rec.latest()

    def resume_from_checkpoint(self) -> str | None:
        """For ``trainer.train(resume_from_checkpoint=...)``: a directory in
        Trainer's layout holding the newest checkpoint of this run's
        unfinished ``train()`` (``run_prefix()``), or None (train afresh).
        The directory is removed once training has restored it."""
        if _settings.text(_settings.REPLAY):
            return self._replay_start()
        self.rec.run()  # a relaunch continues the interrupted run's values
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
        self.rec.claim_run("train()")
        _check_args(args, state)
        resumed = self._resumed
        self._resumed = None
        epochs = state.num_train_epochs
        self.rec.begin(
            resumed[0] if resumed is not None and resumed[1] == state.global_step and state.global_step > 0 else None,
            state.global_step,
            int(epochs) if epochs and args.max_steps <= 0 else None,
            not_resumed_hint="pass trainer.train(resume_from_checkpoint=callback.resume_from_checkpoint())",
        )
        self._want = None
        self._epoch = _last_epoch(state)

    def _check_saved(self) -> None:
        if self._want is not None:
            name, self._want = self._want[0].name, None
            raise HindsightError(
                f"HindsightCallback: Trainer did not write the checkpoint {name} it was asked for "
                "(another callback set control.should_save to False after HindsightCallback)"
            )

    def _between_steps(self) -> None:
        """Trainer has finished the previous step's (or epoch's) logging,
        evaluation and saves: a save asked for was carried out, an exit is due."""
        self._check_saved()
        self.rec.flush_logs()
        if self.rec.exit_pending is not None:
            self._cleanup()
            self.rec.leave_if_pending()

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._between_steps()
        self._epoch = math.floor(state.epoch or 0)
        self._context(state.global_step)
        if self._replay is not None:
            self._replay_progress()
            self.rec.replay_epoch_begin(self._epoch, self._start)
            self._start = None
        else:
            # Trainer restores a train() itself: every epoch runs.
            self.rec.epoch_begin(self._epoch)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._between_steps()
        self._cleanup()  # Trainer has read the resumed checkpoint (its RNG states last)
        # Values logged during the step carry its number, as Trainer's loss does.
        self._context(state.global_step + 1)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._context(state.global_step)
        if self._replay is not None:
            # No fingerprints recorded for Trainer's batches: counted, not compared.
            self._replay.session.step(self._epoch, state.global_step, "")
            return
        if state.epoch is not None and state.epoch >= self._epoch + 1:
            return  # the epoch's last step: its end decides (Trainer resumes a checkpoint here at the next epoch)
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            return  # training ends with this step: the epoch's end decides
        order = self.rec.step_end(self._epoch, state.global_step)
        if order is not None:
            self._ask_save(args, state, control, order)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._context(state.global_step)
        if self._replay is not None:
            self._replay_epoch_ends(state, control, kwargs.get("model"))
            return
        order = self.rec.epoch_end(self._epoch)
        if order is not None:
            self._ask_save(args, state, control, order)
        # Training that max_steps ends inside an epoch closes here: Trainer,
        # resumed from this point, would train one step more than max_steps
        # (it resumes the epoch's loop and checks max_steps after a step), so
        # a signal now lets it finish instead of exiting. The exit waits for
        # Trainer's save (on_save) or the next step.
        ends_mid_epoch = 0 < state.max_steps <= state.global_step and state.epoch < self._epoch + 1
        self.rec.epoch_done(self._epoch, None if order is None else order.name, closing=ends_mid_epoch)

    def _ask_save(self, args: Any, state: Any, control: Any, order: _fit.SaveOrder) -> None:
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        # Trainer's own save_strategy may want this checkpoint too (decided
        # before us, by its DefaultFlowCallback): then it stays where it is.
        # A checkpoint pushed to the Hub is uploaded from its directory in the background: it stays too.
        ours = not control.should_save and not folder.exists() and not args.push_to_hub
        control.should_save = True
        self._want = (order, ours)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._want is None:
            return  # Trainer's own checkpoint
        order, ours = self._want
        self._want = None
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not folder.is_dir():
            raise NotFoundError(f"HindsightCallback: Trainer's checkpoint {folder} is missing after its save")
        meta: dict[str, object] = {
            "transformers": transformers.__version__,
            "epoch": self._epoch,
            "global_step": state.global_step,
            "kind": "step" if getattr(_native.CheckpointId.parse(order.name), "kind", None) == "step" else "epoch",
        }
        tree = {"files": _pack_dir(folder), "global_step": state.global_step, "epoch": state.epoch}
        if ours:
            # Removed before an exit the save may lead to; its files are in `tree`.
            shutil.rmtree(folder, ignore_errors=True)
        if self.rec.exit_pending is not None:
            self._cleanup()
        self.rec.save(order, tree, meta)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not logs or not state.is_world_process_zero:
            return
        if self._replay is not None and ("train_runtime" in logs or self._replay.past_plan):
            return  # train()'s closing summary: it covers the recorded train() calls, not this worker's
        # Values logged outside train() (a trainer.evaluate() after it) are
        # the script's, at its top level, as hs.log after a loop.
        ctx = [("epoch", self._epoch), ("step", state.global_step)] if self._training else []
        # No resume or replay computes the clock readings or train()'s closing mean again.
        kept = {k: v for k, v in logs.items() if k != "epoch" and not k.endswith(_TIMINGS) and k not in _PER_CALL}
        self.rec.log(ctx, kept)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._training = False
        self._between_steps()
        self._cleanup()
        if self._replay is not None:
            self._replay_progress()
            self.rec.replay_end(self._stopped)
            return
        # The mark of a finished train(): resume_from_checkpoint then starts
        # the next one afresh instead of restoring this one.
        self.rec.finish(
            self._epoch,
            {"epoch": self._epoch, "global_step": state.global_step},
            {"transformers": transformers.__version__},
        )

    # -- replay: a worker of `hindsight replay` --------------------------------------------
    # Trainer cannot skip an epoch's training, but it resumes from its own
    # checkpoints: a worker starts train() from the checkpoint its plan
    # restores before the first epoch it executes (or afresh at epoch 0),
    # executes its epochs, where every value Trainer logs is compared with
    # the recorded one and the weights at each checkpointed epoch end with
    # the checkpoint, and stops after the last epoch the plan needs.
    def _replay_start(self) -> str | None:
        start = self.rec.replay_start()
        if start.checkpoint is None:
            self._start = start  # train() from the start executes its epoch
            return None
        t0 = time.perf_counter()
        path = self._materialize(start.checkpoint)
        self.rec.replay_restored(start, time.perf_counter() - t0)
        return path

    def _replay_progress(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.rec.replay_progress(pending)

    def _replay_epoch_ends(self, state: Any, control: Any, model: Any) -> None:
        check, last = self.rec.replay_epoch_end(self._epoch)
        if check is not None and model is not None:
            self._check_weights(self._epoch, check, model)
        self._pending = self._epoch  # its progress line once Trainer has evaluated it
        if last and not control.should_training_stop:
            control.should_training_stop = True
            self._stopped = True

    def _check_weights(self, epoch: int, name: str, model: Any) -> None:
        """Stop unless the weights this worker trained are the checkpoint's."""
        import torch

        live = model.state_dict()
        compared = 0
        for entry in self.store.load(name)["files"]:
            for key, want in (entry.get("tensors") or {}).items():
                have = live.get(key)
                if have is None:
                    continue
                compared += 1
                if not torch.equal(have.detach().cpu(), want):
                    self.rec.replay_differs(epoch, name, f"{entry['path']}/{key}", "the weights differ")
        if not compared:
            print(f"hindsight: note: no weight of {name} matched the model's names; not compared", file=sys.stderr)


def _check_args(args: Any, state: Any) -> None:
    """What Trainer cannot resume exactly, refused before anything is recorded."""
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

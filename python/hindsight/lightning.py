"""PyTorch Lightning integration: hindsight checkpoints, preemption and
retention for ``Trainer.fit``.

    import hindsight as hs
    from hindsight.lightning import HindsightCheckpoint

    store = hs.Store("ckpts")
    cb = HindsightCheckpoint(store, keep_last=2)
    trainer = L.Trainer(max_epochs=10, callbacks=[cb])
    trainer.fit(model, datamodule=dm, ckpt_path=HindsightCheckpoint.latest_path(store))
    # first run: latest_path is None, training starts afresh; after a
    # preemption (exit status 85) the same command resumes where it stopped.

``store`` may be left out: the callback then uses the project's store, where
the script's hindsight run keeps its checkpoints (``$HINDSIGHT_STORE``, else
``<project home>/store``), and ``HindsightCheckpoint.latest_path()`` (no
argument) looks there.

LightningCLI: both classes take typed arguments with defaults, so either

    cli = LightningCLI(Model, DataModule, run=False, trainer_defaults={
        "logger": lazy_instance(HindsightLogger),      # jsonargparse.lazy_instance
        "callbacks": [ModelCheckpoint(monitor="val_loss"), HindsightCheckpoint()]})
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=HindsightCheckpoint.latest_path())
    cli.trainer.test(ckpt_path="best", datamodule=cli.datamodule)

or, on the command line, ``--trainer.logger=hindsight.lightning.HindsightLogger
--trainer.callbacks+=hindsight.lightning.HindsightCheckpoint`` (options such as
``--trainer.callbacks.keep_last=2``). ``HindsightLogger``'s ``save_dir`` (default
``<project home>/lightning/<run id>``) is where ``SaveConfigCallback`` writes
``config.yaml`` and, without a ``dirpath``, ``ModelCheckpoint`` its files. A
relaunch after a preemption continues the run in the same directory, so
LightningCLI needs ``save_config_kwargs={"overwrite": True}`` there.

What the callback does:

* Saves the trainer's full checkpoint (the dict Lightning's own
  ``ModelCheckpoint`` writes: model ``state_dict``, optimizer and LR scheduler
  states, loop progress incl. mid-epoch position, callback states,
  hyper-parameters, precision plugin state), plus the Python / NumPy / torch /
  CUDA RNG states, into a :class:`hindsight.Store` at the end of every
  ``every_n_epochs``-th training epoch and, if set, every
  ``every_n_train_steps`` optimizer steps. ``store.save`` returns once the
  changed bytes are copied; hashing and writing happen in the background.
  Names: ``<prefix>.epoch-000003`` (end of epoch 3, 0-based as
  ``trainer.current_epoch``) and ``<prefix>.epoch-000003.step-000000420``
  (mid-epoch, after global step 420).
* Preemption: SIGTERM and SIGUSR1 (SIGINT with ``catch_sigint=True``) only set
  a flag. At the next optimizer-step boundary (``on_train_batch_end``) or at
  the epoch end, it writes a checkpoint, waits until it is durable, and
  exits with the checkpoint exit code: ``exit_code=...``, else HTCondor's
  ``CheckpointExitCode`` from ``$_CONDOR_JOB_AD``, else
  ``$HINDSIGHT_EXIT_CODE``, else 85 (``sys.exit``: Lightning's ``on_exception``
  hooks and teardown run on the way out). A signal at an epoch's last step
  (or during the validation after it) is acted on at the epoch's end, and
  the exit waits until Lightning has finished the epoch (its
  ``on_train_epoch_end`` hooks, the epoch's logged values): Lightning
  resumes a checkpoint taken after an epoch's last batch at the next epoch,
  without that epoch's validation and end hooks. ``requeue=True`` (or
  ``$HINDSIGHT_SLURM_REQUEUE=1``) runs ``scontrol requeue $SLURM_JOB_ID``
  first. During ``fit`` the callback replaces Lightning's own SIGTERM handler
  (which stops training with exit status 0 and no checkpoint) and, being
  installed first, keeps Lightning's Slurm SIGUSR1 auto-requeue handler (an
  ``hpc_ckpt_*.ckpt`` ``torch.save`` plus requeue) from being installed; pass
  ``plugins=[SLURMEnvironment(auto_requeue=False)]`` on Slurm anyway so that
  ``fit(ckpt_path=None)`` never picks up an old ``hpc_ckpt`` file.
* Resume: ``trainer.fit(model, ckpt_path="hindsight://<name>")``. The callback
  wraps the strategy's ``CheckpointIO`` (in its ``setup`` hook, before
  Lightning restores) with :class:`HindsightCheckpointIO`, which reads
  ``hindsight://`` paths from the store and passes every other path to the
  wrapped IO unchanged. ``HindsightCheckpoint.latest_path(store)`` names the
  newest checkpoint of the newest fit, and None when there is none or that
  fit finished: a finished fit leaves an ``<prefix>.epoch-<n>.end`` mark, and
  running the script again trains a new fit (with whatever arguments it now
  has) under ``<prefix>.fit2`` (then ``.fit3``, ...) instead of restoring the
  old one and training nothing. To extend a finished fit, name its last
  checkpoint: ``ckpt_path="hindsight://<prefix>.epoch-000009"``. Lightning restores the model,
  optimizers, schedulers, callbacks and the fit loop (epoch, global step,
  batch position); the callback restores the RNG states (``restore_rng``).
* Hindsight logging: ``Trainer(logger=HindsightLogger())`` records the
  script as a hindsight run (source, arguments, the module's
  hyper-parameters) and every ``self.log`` value Lightning hands its loggers
  at its (epoch, global step); with the callback, ``hs.log`` in
  ``training_step`` gets the same context, and ``hs.log`` in the epoch hooks
  (``on_train_epoch_end``, ``on_validation_epoch_end``) the epoch. Read them
  with ``hs.dataframe``, ``hindsight logs``, ``hindsight plot``. Values reach
  the log database before each checkpoint the callback saves, and those
  Lightning hands over after it (the step's own ``self.log`` values, the
  epoch's aggregates, ``hs.log`` in the module's ``on_train_epoch_end``) at
  the next batch or epoch start (a ``kill -9`` in that instant, after the
  checkpoint's background commit, can lose them; any other loses no value a
  resume would not compute again). A run stopped by a signal (or killed) is
  continued in the same run by the relaunch that resumes the fit, also when
  nothing is left to train.
* Replay: with ``HindsightLogger`` (or any ``hs.*`` call) the callback
  records every epoch, with its time and checkpoint, in the run, and
  ``hindsight replay train.py`` computes new ``hs.log`` statements in the
  module's hooks. A worker runs the fit from epoch 0 to the last epoch it
  needs: an epoch it restores skips training (the module's
  ``on_train_batch_start`` answers -1), then at the epoch's end restores its
  checkpoint through Lightning's own restore (model, precision, callbacks,
  optimizers, schedulers; the step counters are set from it) and runs
  validation on it, so probes in ``on_train_epoch_end``,
  ``on_validation_epoch_end`` and ``validation_step`` see the recorded
  state. An epoch it executes trains as recorded (probes in
  ``training_step``). ``latest_path`` answers None in a worker, and
  ``ModelCheckpoint`` / ``EarlyStopping`` are left out of the fit. After
  the fit they are back with the states the recorded fit ended with (kept in
  its end mark), so ``trainer.test/validate/predict(ckpt_path="best"|"last")``
  load the file the recording loaded; a file changed since (size or
  modification time), missing, or not among the recorded callback's files is
  refused, naming it, as is an evaluation of the fitted module itself when the
  replay's fit stopped before the recorded last epoch (``--where``). A hook
  method the recording did not have may be added to hold probes (e.g.
  ``on_validation_epoch_end`` with only ``hs.log``) where it overrides
  Lightning's own no-op hook of a direct ``LightningModule``/``Callback``
  subclass. Values an evaluation step logs (``self.log(..., on_step=True)``
  in ``validation_step``/``test_step``) are recorded at (epoch, the batch's
  place in that validation or test run), the same in every process; Lightning's
  own count runs on over the process's evaluations (sanity check included),
  which a resumed fit or a replay counts differently.
* Retention (a union; the newest checkpoint is always kept):
  ``keep_last=N`` epoch-end checkpoints, ``keep_best=K`` by ``monitor``
  (a key of ``trainer.callback_metrics`` at epoch end, ``mode`` "min" or
  "max"; the value is stored in the checkpoint's metadata so it survives
  restarts; metrics logged in training/validation steps qualify, ones logged
  in ``LightningModule.on_train_epoch_end`` do not, as that hook runs after
  the callback's), ``keep_every=N`` (epochs that are multiples of N). Mid-epoch
  checkpoints are dropped once an epoch-end checkpoint of the same or a later
  epoch exists; of the newer ones the ``keep_last`` newest (at least one)
  stay. Without any ``keep_*`` nothing is removed. Removal is durable at
  once; ``gc`` reclaims the chunks when ``fit`` ends.

The callback's own state in the dict (the RNG states, in every ``.ckpt`` that
``ModelCheckpoint`` writes too) is tensors and plain Python values, so those
files load with ``torch.load(weights_only=True)`` (``ckpt_path="best"``).

Non-tensor values: everything Lightning itself puts in the dict (ints,
floats, strings, nested dicts/lists/tuples, ``None``) is stored natively, so
loading never runs code. Only user-provided extras can fall outside that,
typically hyper-parameters (``save_hyperparameters`` of a ``Path``, an
``Enum``, a ``Namespace``, an OmegaConf container) or values added in
``on_save_checkpoint``. Those are refused with an ``UnsupportedTypeError``
naming the key; hyper-parameters are checked when ``fit`` starts, not after
the first epoch. ``allow_pickle=True`` (on the callback; it is passed to the
``CheckpointIO`` it installs) pickles such values and lets loading unpickle
them: use it only for a store you trust.

Limitations:

* Mid-epoch resume restores Lightning's loop position, but the data order is
  Lightning's business: with a plain ``DataLoader`` the rest of the epoch is
  drawn from a fresh iterator (Lightning warns "your dataloader is not
  resumable"), so the samples seen differ from an uninterrupted run. A
  loader with ``state_dict``/``load_state_dict`` has its state saved and
  restored by Lightning: with ``hindsight.data.Loader`` a signal at any step
  resumes at the exact next batch (tested: weights and every logged value
  bit-identical to an uninterrupted run; Lightning sets its epoch through
  ``loader.sampler.set_epoch``). Epoch-end resume is exact on CPU (tested: bit-identical weights with
  shuffling and dropout, thanks to the restored RNG states).
* A signal during validation or a long epoch-end hook is acted on after it.
* With ``accumulate_grad_batches > 1`` the signal checkpoint waits for the
  next optimizer step (accumulated gradients are not part of a checkpoint).
* Strategies: single device and DDP (rank 0 writes; the ranks agree on a
  stop as an ``hs.loop`` recording's do, so every rank stops at the same
  step and rank 0 names the signal any rank got; tested with 2 CPU ranks on
  gloo under Lightning's launcher: a signal to rank 1, then an exact
  mid-epoch resume with a resumable loader). Sharded strategies that bypass
  ``CheckpointIO`` or shard the state dict (DeepSpeed, FSDP sharded state)
  are not supported.
* ``lightning.pytorch`` is used when installed, else ``pytorch_lightning``;
  when both are, the one already imported wins, and
  ``$HINDSIGHT_LIGHTNING=pytorch_lightning`` forces a choice (a callback of
  one package is rejected by the other's ``Trainer``).
"""

from __future__ import annotations

from typing import Any

from hindsight._lightning_store import (
    SCHEME,
    Entry,
    checkpoints,
    latest,
    latest_path,
    load,
    project_store,
)

__all__ = [
    "SCHEME",
    "Entry",
    "HindsightCheckpoint",  # noqa: F822 - built on first access (module __getattr__)
    "HindsightCheckpointIO",  # noqa: F822 - built on first access (module __getattr__)
    "HindsightLogger",  # noqa: F822 - built on first access (module __getattr__)
    "checkpoints",
    "latest",
    "latest_path",
    "load",
    "project_store",
]


def __getattr__(name: str) -> Any:
    # The classes subclass Lightning's: defined on first use, so that
    # importing this module does not import Lightning.
    if name in ("HindsightCheckpoint", "HindsightCheckpointIO", "HindsightLogger"):
        from hindsight import _lightning

        return getattr(_lightning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Keras 3 integration (torch backend): hindsight logging, checkpoints in a
hindsight store, preemption and exact resume of ``model.fit``.

    import os; os.environ["KERAS_BACKEND"] = "torch"
    import keras
    from hindsight.keras import HindsightCallback

    model.fit(x, y, epochs=10, callbacks=[HindsightCallback()])
    # first run: trains afresh; after a preemption (exit status 85) the
    # same command resumes exactly where it stopped.

What the callback does:

* Records the fit in the script's hindsight run: the epoch's logs
  (``loss``, compiled metrics, ``val_*``) at their epoch, and ``hs.log``
  calls made during the fit (a callback, a custom ``train_step``) at the
  epoch and step: ``hs.dataframe``, ``hindsight logs``, ``hindsight plot``
  read them.
* Checkpoints when the run session (the engine's ``runs::session``) says:
  at the end of every ``every_n_epochs``-th epoch and, if set, every
  ``every_n_train_steps`` batches. A checkpoint holds every model variable
  (weights, non-trainable state, dropout seed states), the optimizer's
  variables (its step count among them), the epoch's running metrics, the
  position (epoch, batch) and torch's RNG state at the epoch's start and
  at the checkpoint; unchanged tensors are stored once, every byte is
  checked when read.
* Preemption: SIGTERM and SIGUSR1 (SIGINT with ``catch_sigint=True``) only
  set a flag. At the next batch's end the fit checkpoints and the process
  exits with the checkpoint exit code (``exit_code=...``, else HTCondor's,
  else ``$HINDSIGHT_EXIT_CODE``, else 85) once the checkpoint is durable;
  ``requeue=True`` runs ``scontrol requeue`` first.
* Resume: the same command continues the run (same script and arguments,
  as for ``hs.loop``). The callback restores the variables, starts the fit
  at the checkpoint's epoch (Keras's own ``initial_epoch`` hook, as its
  ``BackupAndRestore`` does), replays the epoch's shuffle from the saved RNG
  state and moves the data iterator past the batches already trained
  without training them, then puts back the checkpoint's RNG state and
  running metrics. Keras's ``BackupAndRestore(save_freq=N)`` restarts the
  epoch from its first batch with the mid-epoch weights instead. A finished
  fit is not continued: the next run trains afresh.
* Retention (the newest checkpoint always stays): ``keep_last``,
  ``keep_every`` epochs, ``keep_best`` by ``monitor`` (a key of the epoch's
  logs, e.g. ``val_loss``).
* Replay: ``hindsight replay train.py`` of a script with a new ``hs.log``
  in a callback restores the checkpoint of the epoch before the first
  epoch a worker needs, executes its epochs (every value the recording
  logged is compared with the replayed one, and the weights at each
  checkpointed epoch end with the checkpoint's) and stops the fit after
  the last one it needs.

Exactness: on CPU (and deterministic kernels) a fit interrupted at any
batch and resumed ends with bit-identical weights and logs (tested, with
dropout and shuffling). The data's order is the one Keras draws from
torch's RNG as an epoch's iterator starts (arrays, tensors, a torch
``DataLoader`` without its own generator). Every trained batch is
fingerprinted, and a resume inside an epoch checks each batch it skips
against the interrupted fit's: a data source whose order the restored RNG
states do not reproduce (a ``PyDataset`` that reshuffles its own index in
``on_epoch_end``, a generator) stops the resume before anything is
trained, naming the batch. At an epoch's start there is no batch to check:
such a source resumes there with the order it has in the new process.

Refused, naming the reason: a backend other than torch,
``steps_per_execution > 1`` (no checkpoint can fall between the batches of
one call), a checkpoint whose variables do not fit the model, and a replay
whose plan needs an epoch restored in the middle of the fit.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HindsightCallback"]  # noqa: F822 - built on first access (module __getattr__)


def __getattr__(name: str) -> Any:
    # The class subclasses keras.callbacks.Callback: defined on first use,
    # so that importing this module does not import keras.
    if name == "HindsightCallback":
        from hindsight import _keras

        return _keras.HindsightCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

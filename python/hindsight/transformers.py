"""Hugging Face ``transformers.Trainer`` integration: hindsight logging,
checkpoints in a hindsight store, preemption and exact resume.

    from hindsight.transformers import HindsightCallback

    cb = HindsightCallback()                       # the project's store; store="ckpts" picks another
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume_from_checkpoint())
    # first run: None, training starts afresh; after a preemption (exit
    # status 85) the same command resumes exactly where it stopped.

What the callback does:

* Records each ``train()`` in the script's hindsight run: every value
  Trainer logs (``loss``, ``learning_rate``, ``grad_norm``, ``eval_*``, the
  final ``train_*``) at its (epoch, global step), and ``hs.log`` calls made
  during training (a custom callback, ``compute_metrics``, a
  ``compute_loss`` override) in the same context: ``hs.dataframe``,
  ``hindsight logs``, ``hindsight plot`` read them. A value logged during a
  step's forward pass gets that step's number, as Trainer's own ``loss``.
  Values logged outside ``train()`` (a ``trainer.evaluate()`` after it) are
  the script's top-level values. Not recorded: Trainer's clock readings
  (``*_runtime``, ``*_per_second``), which no resume or replay computes
  again, and ``train()``'s closing ``train_loss`` (Trainer's mean over the
  steps of that call, which a resume changes; the per-step ``loss`` values
  hold the run's).
* Checkpoints when the run session (the engine's ``runs::session``) says:
  at the end of every ``every_n_epochs``-th epoch and, if set, every
  ``every_n_train_steps`` optimizer steps. The checkpoint is Trainer's own
  (``_save_checkpoint``: model, optimizer, scheduler, grad scaler, RNG
  states, ``TrainerState`` with the global step, epoch and log history),
  written where Trainer writes it and moved into the store: safetensors
  files as tensors (unchanged ones are stored once), the other files as
  bytes, every byte checked when read. Trainer's own ``save_strategy``
  checkpoints are left as they are.
* Preemption: SIGTERM and SIGUSR1 (SIGINT with ``catch_sigint=True``) only
  set a flag. At the next optimizer-step boundary (at the epoch's end for
  the epoch's last step) Trainer finishes that step's logging and
  evaluation, saves, and the process exits with the checkpoint exit code
  (``exit_code=...``, else HTCondor's, else ``$HINDSIGHT_EXIT_CODE``, else
  85) once the checkpoint is durable; ``requeue=True`` runs ``scontrol
  requeue`` first.
* Resume: checkpoints are named after the script's hindsight run
  (``<prefix>.<run id>.epoch-000003``). ``resume_from_checkpoint()`` writes
  the newest one of the run's unfinished ``train()`` back into Trainer's
  directory layout (a temporary directory, removed once training runs) and
  returns its path;
  Trainer restores the model, optimizer, scheduler, RNG states and its
  state, and skips the batches of the epoch already trained by replaying
  its sampler (``ignore_data_skip=True`` is refused: the resumed run would
  train on other batches). The run's values continue in the same hindsight
  run. The run is the one the relaunch continues (same script and
  arguments, as for ``hs.loop``): another script in the same project, or the
  same script with other arguments, is another run and trains afresh
  instead of resuming a checkpoint it did not write. A finished run is not
  continued: running the script again trains afresh in a new run.
* Retention (the newest checkpoint always stays): ``keep_last``,
  ``keep_every`` epochs, ``keep_best`` by ``monitor`` (a key Trainer logs,
  e.g. ``eval_loss``; its last value at the epoch's end).
* Replay: ``hindsight replay train.py`` of a script with new ``hs.log``
  statements in a Trainer callback, ``compute_metrics`` or a
  ``compute_loss`` override re-executes the epochs it needs (``-j N``
  splits them over workers): a worker's ``resume_from_checkpoint()``
  answers the checkpoint of the epoch before its first one, Trainer resumes
  there, and the worker stops after its last epoch. Every value Trainer
  logged while recording (``loss``, ``learning_rate``, ``eval_loss``, ...;
  not the clock readings ``*_runtime``, ``*_per_second``) is compared with
  the replayed one, and the weights at the end of each checkpointed epoch
  with the checkpoint's; the first difference stops the replay, naming it.
  Trainer cannot skip an epoch's training, so a replay never restores an
  epoch in place of running it: even an epoch-level probe costs the epochs'
  training time.

Exactness: on CPU (and deterministic kernels) a run interrupted at any step
and resumed ends with bit-identical weights and logs each step's values
once (tested, with dropout, shuffling and evaluations). Trainer restores
the RNG states after fetching the first batch of a resumed epoch: a data
collator that draws random numbers (``DataCollatorForLanguageModeling(mlm=
True)``) makes that batch and what follows differ from the uninterrupted
run. A signal during the last step of a run that ``max_steps`` ends inside
an epoch lets the run finish (exit status 0): Trainer resumed there would
train a step beyond ``max_steps``.

Refused, naming the reason: a second ``train()`` in the same process (its
values and epochs would overwrite the first's in the run; run each stage as
a script of its own), more than one process (``world_size > 1``),
``save_only_model=True``, ``ignore_data_skip=True``, ``save_strategy="best"``
(it declines the checkpoints it did not choose), hyper-parameter search, and
a replay worker whose plan needs an epoch restored in the middle of
``train()``. A checkpoint the callback asked for that Trainer did not write
(another callback cleared ``control.should_save``) stops training with an
error naming it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HindsightCallback"]  # noqa: F822 - built on first access (module __getattr__)


def __getattr__(name: str) -> Any:
    # The class subclasses transformers.TrainerCallback: defined on first
    # use, so that importing this module does not import transformers.
    if name == "HindsightCallback":
        from hindsight import _transformers

        return _transformers.HindsightCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
* Resume: ``resume_from_checkpoint()`` writes the newest checkpoint of the
  newest unfinished ``train()`` back into Trainer's directory layout (a
  temporary directory, removed once training runs) and returns its path;
  Trainer restores the model, optimizer, scheduler, RNG states and its
  state, and skips the batches of the epoch already trained by replaying
  its sampler (``ignore_data_skip=True`` is refused: the resumed run would
  train on other batches). The run's values continue in the same hindsight
  run. A finished ``train()`` leaves an ``<prefix>.epoch-<n>.end`` mark, so
  running the script again trains afresh under ``<prefix>.fit2``.
* Retention (the newest checkpoint always stays): ``keep_last``,
  ``keep_every`` epochs, ``keep_best`` by ``monitor`` (a key Trainer logs,
  e.g. ``eval_loss``; its last value at the epoch's end).

Exactness: on CPU (and deterministic kernels) a run interrupted at any step
and resumed ends with bit-identical weights and logs each step's values
once (tested). Trainer restores the RNG states after fetching the first
batch of a resumed epoch: a data collator that draws random numbers
(``DataCollatorForLanguageModeling(mlm=True)``) makes that batch and what
follows differ from the uninterrupted run.

Not supported (refused, naming the reason): ``hindsight replay`` of a
Trainer script, more than one process (``world_size > 1``),
``save_only_model=True``, ``ignore_data_skip=True``.
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

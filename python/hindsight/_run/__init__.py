"""Recording and replaying a training run: hs.arg, hs.loop, hs.log,
hs.checkpointing. One run per process, created at the first call: a
`RecordRun` (record.py) for a plain `python train.py`, a `ReplayRun`
(replay.py) in a worker that `hindsight replay` started."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from hindsight import _native, _settings
from hindsight._run import dataiter, jupyter
from hindsight._run.common import ENV_HOME, ENV_REPLAY, Run, T, _script_path
from hindsight._run.record import RecordRun
from hindsight._run.replay import ReplayRun
from hindsight.errors import InvalidArgumentError, ReplayError

__all__ = [
    "ENV_HOME",
    "ENV_REPLAY",
    "Run",
    "_script_path",
    "arg",
    "args",
    "checkpointing",
    "current",
    "log",
    "loop",
    "notebook",
    "run_id",
]

_RUN: Run | None = None
# The loop context a framework's hooks set (Lightning's epoch and step) and
# whether values there are dropped, kept here too so that a run created
# later (by the first hs.log inside a training_step) starts in them.
_FRAMEWORK_CTX: list[tuple[str, int]] | None = None
_FRAMEWORK_DROP = False


def current() -> Run:
    global _RUN
    if _RUN is None or _RUN.finished:
        dataiter.install()
        plan = _settings.text(ENV_REPLAY)
        try:
            _RUN = ReplayRun(plan) if plan else RecordRun()
        except (InvalidArgumentError, ReplayError) as e:
            # A bad $HINDSIGHT_* value, a run name another command holds, a
            # run another process is resuming:
            # the user's to fix, said in one line that names it, not as a
            # traceback through hindsight's start-up.
            sys.stderr.write(f"hindsight: error: {e}\n")
            sys.stderr.flush()
            raise SystemExit(2) from None
        _RUN.values.framework_ctx, _RUN.values.framework_drop = _FRAMEWORK_CTX, _FRAMEWORK_DROP
    return _RUN


def set_framework_context(ctx: list[tuple[str, int]] | None) -> None:
    """The context of hs.log calls outside any hs.loop, set by a framework's hooks."""
    global _FRAMEWORK_CTX
    _FRAMEWORK_CTX = ctx
    if _RUN is not None:
        _RUN.values.framework_ctx = ctx


def framework_context() -> list[tuple[str, int]] | None:
    """The context `set_framework_context` set last."""
    return _FRAMEWORK_CTX


def set_framework_drop(on: bool) -> None:
    """Whether values logged in the framework's current context are dropped
    (Lightning's sanity check, an epoch a replay skips)."""
    global _FRAMEWORK_DROP
    _FRAMEWORK_DROP = on
    if _RUN is not None:
        _RUN.values.framework_drop = on


def _after_fork() -> None:
    # A forked child (DataLoader worker) must not write into the parent's run.
    global _RUN
    if _RUN is not None:
        _RUN.finished = True
    _RUN = None


os.register_at_fork(after_in_child=_after_fork)
# DataLoader iterators made before the first hs.* call (minGPT makes its
# `data_iter` before the loop) can be checkpointed too.
dataiter.install()


# -- public API -------------------------------------------------------------------
def arg(name: str, default: T) -> T:
    """A recorded hyper-parameter; `--name value` on the command line overrides the default.
    During replay it returns the recorded value."""
    value: T = current().arg(name, default)
    return value


def args(parser: Any, argv: list[str] | None = None) -> Any:
    """`parser.parse_args(argv)` for a script that keeps its argparse, with
    the result recorded as the run's arguments (JSON-able values). During
    replay it returns the recorded values. Its options count as known
    flags for the check of misspelt ones."""
    return current().parse_args(parser, argv)


def log(name: str, value: T, *, rank: int | str = 0) -> T:
    """Record `value` under `name` in the current loop context; returns `value`.

    Under several ranks (torchrun, srun) the run keeps rank 0's values;
    ``rank="all"`` keeps every rank's, each with its rank as the innermost
    context (a ``rank`` column in ``hindsight logs`` and ``hs.dataframe``).
    """
    if rank != 0 and rank != "all":
        raise InvalidArgumentError(f"hs.log({name!r}, ..., rank={rank!r}): rank must be 0 (the default) or 'all'")
    current().log(name, value, every_rank=rank == "all")
    return value


def loop(name: str, iterable: Iterable[T]) -> Iterator[T]:
    """Iterate and record the loop context. The outermost `hs.loop` delimits
    checkpoints; the first `hs.loop` nested in it is the block replay can skip."""
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError("hs.loop(name, iterable): name must be a non-empty string")
    return current().loop(name, iterable)


@contextmanager
def checkpointing(
    *,
    every: int | None = None,
    keep_last: int | None = None,
    keep_best: int | None = None,
    best_metric: str | None = None,
    best_mode: str = "min",
    keep_every: int | None = None,
    safety_minutes: float | None = None,
    exit_code: int | None = None,
    requeue: bool | None = None,
    store: str | os.PathLike[str] | None = None,
    local_first: str | os.PathLike[str] | None = None,
    transient: Iterable[str] = (),
    **objects: Any,
) -> Iterator[None]:
    """Objects (modules, optimizers, schedulers, grad scalers, tensors) whose
    state is checkpointed at the end of each outer-loop iteration's training
    steps, restored during replay, and resumed after preemption.

    With no objects (``hs.checkpointing()``), they are found when the outer
    loop starts: the modules, optimizers, LR schedulers and grad scalers its
    body reads (also as arguments of the functions it calls), by variable
    name. ``hindsight record --explain train.py`` prints what was found.

    Period: adaptive by default (seed 001's Joint Invariant, epsilon 1/15 or
    $HINDSIGHT_EPSILON, so checkpointing costs at most epsilon of training
    time); ``every=N`` (or $HINDSIGHT_CHECKPOINT_EVERY) fixes it.

    Preemption: SIGTERM and SIGUSR1 (SIGINT with $HINDSIGHT_CATCH_SIGINT=1)
    make the loop checkpoint at the next step boundary, wait until durable,
    and exit with ``exit_code`` (default: HTCondor's CheckpointExitCode, else
    $HINDSIGHT_EXIT_CODE, else 85); ``requeue=True`` (or
    $HINDSIGHT_SLURM_REQUEUE=1) runs ``scontrol requeue $SLURM_JOB_ID`` first.
    ``safety_minutes`` (or $HINDSIGHT_SAFETY_MINUTES) adds a time-based
    checkpoint so a kill -9 loses at most that much work.

    Retention (a union; the newest checkpoint is always kept): ``keep_last=N``,
    ``keep_best=K`` by the epoch-level log ``best_metric`` (``best_mode`` "min"
    or "max"), ``keep_every=N`` epochs.

    Loop variables: the variables the outer loop and its inner loop assign
    that later code reads (an iteration counter, a prefetched batch, the
    last loss) are checkpointed too, when storable (numbers, strings,
    tensors, arrays, plain containers of them). One that is not is refused
    when the first block ends, naming it; ``transient=["pbar"]`` declares
    variables whose value need not survive a resume (a progress bar, an
    open file).

    Destination: ``store`` is a directory (local or a shared file system) or
    ``"s3://bucket/prefix"`` (AWS_* variables configure the endpoint and
    credentials); default $HINDSIGHT_STORE, else the project's
    ``.hindsight/store``. The run remembers it: replay and resume read there.
    ``local_first`` (or $HINDSIGHT_LOCAL_FIRST) is a local directory each
    checkpoint is committed to first and then uploaded from in the
    background; the exit on a signal waits for the upload.
    """
    if every is not None:
        _native.checked_every("hs.checkpointing", "every", every)
    retention = _native.Retention.checked(
        "hs.checkpointing", "best_metric", "best_mode", keep_last, keep_best, best_metric, best_mode, keep_every
    )
    for key, obj in objects.items():
        torch = sys.modules.get("torch")
        if not hasattr(obj, "state_dict") and not (torch is not None and isinstance(obj, torch.Tensor)):
            raise InvalidArgumentError(
                f"hs.checkpointing({key}=...): {type(obj).__qualname__} has neither "
                "state_dict/load_state_dict nor is a tensor"
            )
    if isinstance(transient, str) or not all(isinstance(t, str) and t.isidentifier() for t in transient):
        raise InvalidArgumentError(
            f"hs.checkpointing(transient={transient!r}): a list of variable names, e.g. transient=['pbar']"
        )
    transient = set(transient)
    run = current()
    run.set_store(store, local_first)
    run.objects.update(objects)
    added = transient - run.transient
    run.transient |= added
    # No objects: hands-free, they are found when the outer loop starts.
    run.hands_free = not objects
    run.configure(every, safety_minutes, exit_code, None if retention.is_empty() else retention)
    if requeue is not None:
        run.requeue = requeue
    try:
        yield
    finally:
        for key in [*objects, *run.discovered]:
            run.objects.pop(key, None)
        run.hands_free, run.discovered = False, {}
        run.transient -= added
        if run._store is not None:
            run._store.flush()


def run_id() -> str:
    run = current()
    if not run.run_id:
        # A following rank learns the job's run when the ranks meet (the
        # outer loop's start): an empty id would name files wrongly.
        raise InvalidArgumentError(
            f"hs.run_id() on rank {run.rank_index} before the outer hs.loop starts: the ranks agree on the "
            "job's one run there (rank 0 creates or resumes it); call it inside or after the loop"
        )
    return str(run.run_id)


def notebook(path: str | os.PathLike[str]) -> None:
    """In a Jupyter kernel that does not say which notebook it runs (one
    started without JPY_SESSION_NAME): the notebook, whose directory holds
    the project and whose cells are the recorded source. Call it before
    the first other hs.* call."""
    p = jupyter.checked(path)
    if _RUN is not None and not _RUN.finished and _RUN.script != p:
        raise InvalidArgumentError(
            f"hs.notebook({os.fspath(path)!r}): this kernel's run {_RUN.run_id} already records {_RUN.script}; "
            "call hs.notebook before the first other hs.* call"
        )
    jupyter.set_path(p)

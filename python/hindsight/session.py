"""The adapter API of framework integrations: what ``hindsight.lightning``
uses, and what an Accelerate, HF Trainer or Keras integration would.

An integration translates its framework's hooks into these calls. It does
not decide when to save, where to resume or what a replay visits: the
process's run session (the engine's ``runs::session``) does, and answers
each event with an action.

- :func:`run` / :func:`recording` / :func:`replaying`: the process's run, by role.
- :func:`context` / :func:`drop`: where values logged outside ``hs.loop``
  belong (the framework's epoch and step), or that they belong nowhere (a
  sanity check, an epoch a replay skips).
- A replaying run's ``session`` is a ``ReplaySession``: the integration
  sends ``iteration_start``/``block_start``/``step``/``restored_in``/
  ``iteration_end`` as its epochs go by and does what each answer says.
- A recording run's ``session`` is a ``RecordSession`` with the same events;
  its ``step_boundary`` answers None between most steps (nothing to do).

Hook order an integration keeps: ``iteration_start(i)`` ->
``block_start(i)`` -> ``step_boundary(i, j)``... -> ``block_end(i)`` ->
``iteration_end(i)``; see the state diagram in ``docs/architecture.md``.
"""

from __future__ import annotations

from hindsight import _run, _settings
from hindsight._run.common import Run
from hindsight._run.record import RecordRun
from hindsight._run.replay import ReplayRun

__all__ = ["RecordRun", "ReplayRun", "Run", "context", "drop", "recording", "replaying", "run"]


def run() -> Run:
    """The process's run, created if it has none (a `RecordRun`, or a
    `ReplayRun` in a worker started by `hindsight replay`)."""
    return _run.current()


def recording() -> RecordRun | None:
    """The process's recording if one is under way; never creates one."""
    r = _run._RUN
    return r if isinstance(r, RecordRun) and not r.finished else None


def replaying(loop: str) -> ReplayRun | None:
    """In a `hindsight replay` worker whose plan is over the loop named
    `loop` (the framework's epochs: "epoch"), its run; else None."""
    if not _settings.text(_settings.REPLAY):
        return None
    r = _run.current()
    return r if isinstance(r, ReplayRun) and r.plan.loop_name == loop else None


def context(ctx: list[tuple[str, int]] | None) -> None:
    """The loop context of values logged outside any ``hs.loop``: the
    framework's own loops, e.g. ``[("epoch", 3), ("step", 120)]``."""
    _run.set_framework_context(ctx)


def drop(on: bool) -> None:
    """Drop values logged in the framework's context until turned off."""
    _run.set_framework_drop(on)

"""What importing hindsight costs the training thread: the plain script
spends none of it, so a recording charges it to its overhead budget (core
`AdaptivePolicy::observe_startup`). Imported first by `hindsight/__init__`."""

from __future__ import annotations

import time

_started = time.thread_time()
_seconds: float | None = None


def imported() -> None:
    """hindsight's import finished (the end of `hindsight/__init__`)."""
    global _seconds
    if _seconds is None:
        _seconds = max(0.0, time.thread_time() - _started)


def take_import_seconds() -> float:
    """The import's CPU seconds, once: the first recording of the process
    is charged with it, a later one (a notebook's next run) is not."""
    global _seconds
    secs, _seconds = _seconds or 0.0, 0.0
    return secs

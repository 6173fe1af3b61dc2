"""Where a run's script is in its loops (`Position`): a class of its own,
so that `Run` holds what the run is, and this where it stands."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hindsight._run.loopvars import LoopVars


@dataclass
class Position:
    """Where the script is in its hs.loop's: the outer loop and its current
    iteration, the steps (the inner loop) under way, and what the iteration
    started from. One per run: `Run`'s loops move it, its hooks read it."""

    stack: list[list[Any]] = field(default_factory=list)  # [loop name, index], outermost first
    loop_started: bool = False  # an outer loop started since this was last reset (jupyter.on_cell_error)
    outer_name: str | None = None
    outer_idx: int = -1
    outer_value: Any = None  # the integer the loop iterated over, where it was one
    iter_start: float = 0.0  # perf_counter() at the iteration's start
    iterations_started: int = 0
    # The current outer iteration did not start from the state its
    # predecessor left (a replay worker skipped that one): values logged
    # before its inner loop would describe the wrong state, so they are
    # dropped until the inner loop restores or rebuilds it.
    stale_start: bool = False
    # The variables the outer loop and the steps change (loopvars.py).
    outer_vars: LoopVars | None = None
    block_vars: LoopVars | None = None
    # The iteration's start values (outer_vars.snapshot()), and whether its
    # start was kept (these, the RecordRun's iter_rng): see Run._keeps_start.
    iter_values: dict[str, tuple[Any, tuple[int, ...]]] | None = None
    iter_kept: bool = False
    block_live: bool = False  # the steps of the current iteration are under way
    block_done: bool = False  # they ended (or the iteration has none to wait for)
    block_gen: Any = None  # the steps' generator, what an enumerate() around it iterates
    blocks_seen: bool = False  # an iteration of this process ran steps (an inner hs.loop)

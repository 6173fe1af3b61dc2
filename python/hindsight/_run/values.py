"""What a run logs: each value's context and occurrence, and its row for
the log thread (`LogWriter`). `hs.log` inside `hs.loop` takes the loops'
context; a framework's hooks (Lightning, the Trainer and Keras callbacks)
set the context of values logged outside any `hs.loop`. Under several
ranks, rank 0 writes the run's values; a value logged with ``rank="all"``
on another rank waits here until the ranks meet and it goes to rank 0."""

from __future__ import annotations

import json
import sys
from typing import Any

from hindsight._run.logwriter import LogWriter
from hindsight._run.ranks import Ranks
from hindsight.errors import InvalidArgumentError

_INF = float("inf")
#: A logged tensor or array holds at most this many elements.
MAX_LOGGED_ELEMENTS = 10_000


def _to_json(value: Any, name: str, what: str = "hs.log") -> Any:
    """``value`` as plain JSON types (numpy and torch scalars become numbers);
    refuses what cannot be recorded, naming ``what(name)``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if value.numel() > MAX_LOGGED_ELEMENTS:
            raise InvalidArgumentError(
                f"{what}({name!r}): tensor of {value.numel()} elements is too large to log "
                f"(at most {MAX_LOGGED_ELEMENTS}); log a summary such as .norm()"
            )
        return value.detach().cpu().tolist()
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(value, np.ndarray):
            if value.size > MAX_LOGGED_ELEMENTS:
                raise InvalidArgumentError(f"{what}({name!r}): array of {value.size} elements is too large to log")
            return value.tolist()
        if isinstance(value, np.generic):
            return value.item()
    if isinstance(value, (list, tuple)):
        return [_to_json(v, name, what) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v, name, what) for k, v in value.items()}
    raise InvalidArgumentError(
        f"{what}({name!r}): cannot record a value of type {type(value).__qualname__}; "
        "use numbers, strings, bools, or small tensors/arrays"
    )


def _encode(name: str, value: Any) -> str:
    """A logged value as the JSON text the database keeps."""
    t = type(value)
    if t is float and value == value and value not in (_INF, -_INF):
        return repr(value)  # the JSON of a finite float, without the encoder's overhead
    if t is int or t is bool:
        return "true" if value is True else "false" if value is False else str(value)
    return json.dumps(_to_json(value, name))


Context = list[tuple[str, int]]
_Reps = dict[tuple[str, tuple[tuple[str, int], ...]], int]


class Values:
    """The values of one run, on their way to its log thread."""

    def __init__(self, writer: LogWriter, ranks: Ranks | None, leads: bool, rank_index: int) -> None:
        self.writer = writer
        self.ranks = ranks
        self.leads = leads
        self.rank_index = rank_index
        # Values of one name logged so far in one context: a repeated
        # hs.log there is kept as the next occurrence, not overwritten.
        # Contexts inside the steps never recur after their step, so their
        # counts are dropped at each step; the others at each outer iteration.
        self.reps_outer: _Reps = {}
        self.reps_inner: _Reps = {}
        # Loops a framework runs (Lightning): the context of hs.log outside
        # any hs.loop, set by the framework's hooks; occurrences per context.
        self.framework_ctx: Context | None = None
        self.framework_last: Context = []
        # The framework is where no value belongs: Lightning's sanity check,
        # or an epoch a replay skips or has not restored yet.
        self.framework_drop = False
        self.reps_framework: _Reps = {}
        # A following rank's values logged with rank="all", until sent to rank 0.
        self.rank_rows: list[tuple[str, Context, int, str]] = []

    def outer_iteration_starts(self) -> None:
        self.reps_outer = {k: v for k, v in self.reps_outer.items() if not k[1]}  # top level stays

    def step_starts(self) -> None:
        self.reps_inner.clear()

    def log(self, stack: list[list[Any]], name: str, value: Any, every_rank: bool, *, drop: bool) -> None:
        """hs.log: at the context of the `hs.loop`s under way (`stack`), else
        the framework's. `drop`: counted, not kept (an iteration a replay
        does not start from its recorded state, or past its plan)."""
        if not stack and (self.framework_ctx is not None or self.framework_drop):
            if not self.framework_drop:
                self.log_at(self.framework_ctx or [], name, value)
            return
        ctx = [(e[0], e[1]) for e in stack]
        if every_rank:
            ctx.append(("rank", self.rank_index))
        reps = self.reps_inner if len(ctx) > 1 else self.reps_outer
        key = (name, tuple(ctx))
        rep = reps.get(key, 0)
        reps[key] = rep + 1
        if drop:
            return
        if not every_rank:  # `_append`'s common case, a frame fewer on the training thread
            if self.leads:
                self.writer.add((name, ctx, rep, _encode(name, value)))
            return
        self._append(name, ctx, rep, value, every_rank, in_loop=bool(stack))

    def log_at(self, ctx: Context, name: str, value: Any) -> None:
        """`value` at a context of loops a framework runs, not hs.loop."""
        if self.framework_drop:
            return
        # Contexts recur within an epoch (validation between training steps),
        # never across epochs: counts are kept per context, dropped per epoch.
        epoch = ctx[:1]
        if epoch != self.framework_last:
            self.framework_last, self.reps_framework = list(epoch), {}
        key = (name, tuple(ctx))
        rep = self.reps_framework.get(key, 0)
        self.reps_framework[key] = rep + 1
        self._append(name, list(ctx), rep, value, False, in_loop=False)

    def _append(self, name: str, ctx: Context, rep: int, value: Any, every_rank: bool, *, in_loop: bool) -> None:
        if every_rank and self.ranks is not None and not in_loop:
            raise InvalidArgumentError(
                f"hs.log({name!r}, ..., rank='all') outside hs.loop under {self.ranks.size} ranks: every rank's "
                "values reach rank 0 at the outer loop's iteration ends and checkpoints, so log them inside the loop"
            )
        if not self.leads:  # the run's values are rank 0's, and what every rank logs
            if every_rank:
                self.rank_rows.append((name, ctx, rep, _encode(name, value)))
            return
        self.writer.add((name, ctx, rep, _encode(name, value)))

    def gather_ranks(self, extra: list[Any]) -> list[list[Any]]:
        """Every rank sends its ``rank="all"`` values and `extra` to rank 0,
        which buffers the values and gets every rank's extra (others get [])."""
        assert self.ranks is not None
        mine = (self.rank_rows, extra)
        self.rank_rows = []
        extras: list[list[Any]] = []
        for values, their_extra in self.ranks.to_leader(mine) or []:
            for name, ctx, rep, text in values:
                self.writer.add((name, list(ctx), rep, text))
            extras.append(their_extra)
        return extras

"""Logged series out of the run database: `hindsight plot` (a matplotlib
figure, several runs in one) and `hindsight export --tensorboard` (event
files through torch's `SummaryWriter`, which needs the `tensorboard`
package). Values are the engine's (`LogDb::values`: the recorded value where
the run logged one, else the replayed one); this module only lays them out.

The x axis is the training step: a value logged per (epoch, step) sits at
the number of steps logged before it, and a value logged once per epoch at
the last step of its epoch, so epoch-level and step-level series line up
(as TensorBoard users expect from `global_step`). Where nothing is logged
per step, the x axis is the outer loop's value (`epoch` = 1, 2, ... for
`range(1, N)`).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hindsight import _native
from hindsight.errors import HindsightError, InvalidArgumentError, NotFoundError


@dataclass
class Series:
    """One name of one run: points in logging order."""

    run: str
    name: str
    xs: list[int] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)
    wall_s: list[float | None] = field(default_factory=list)


@dataclass
class RunSeries:
    run: str
    args: dict[str, Any]
    x_label: str
    series: dict[str, Series]


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def run_series(db: Any, run: str, names: list[str]) -> RunSeries:
    """The numeric values of `names` in `run`, placed on one step axis."""
    row = db.run(run)
    values = db.values(run, names)
    found = {v.name for v in values}
    missing = [n for n in names if n not in found]
    if missing:
        known = db.log_names(run)
        raise NotFoundError(
            f"run {run} logged no {', '.join(repr(m) for m in missing)} "
            f"(it logged: {', '.join(known) if known else 'nothing'})"
        )
    # Wall-clock time of each value, where the run recorded it.
    written = {(r.name, tuple(r.ctx), r.rep): r.created_ms / 1000 for r in db.logs(run, names) if r.phase == "record"}
    depth = max(len(v.ctx) for v in values)
    iterated: dict[int, int] = {}
    outer = db.outer_loops(run)
    if outer:
        iterated = {it.idx: it.value for it in db.iterations(run, outer[0]) if it.value is not None}
    if depth >= 2:
        # Steps in order: a deepest context's position among all deepest
        # contexts; a shallower one sits at the last step under it.
        deep = sorted({tuple(i for _, i in v.ctx) for v in values if len(v.ctx) == depth})
        position = {ctx: n for n, ctx in enumerate(deep)}

        def x_of(ctx: tuple[int, ...]) -> int:
            if len(ctx) == depth:
                return position[ctx]
            under = [n for c, n in position.items() if c[: len(ctx)] <= ctx]
            return max(under, default=0)

        x_label = "step (" + " × ".join(name for name, _ in next(v.ctx for v in values if len(v.ctx) == depth)) + ")"
    else:

        def x_of(ctx: tuple[int, ...]) -> int:
            return iterated.get(ctx[0], ctx[0]) if ctx else 0

        x_label = next((v.ctx[0][0] for v in values if v.ctx), "value")
    out: dict[str, Series] = {n: Series(run, n) for n in names}
    skipped: dict[str, int] = {}
    for v in sorted(values, key=lambda v: (x_of(tuple(i for _, i in v.ctx)), len(v.ctx), v.rep)):
        y = _number(json.loads(v.value_json))
        if y is None or math.isnan(y):
            skipped[v.name] = skipped.get(v.name, 0) + 1
            continue
        s = out[v.name]
        s.xs.append(x_of(tuple(i for _, i in v.ctx)))
        s.ys.append(y)
        s.wall_s.append(written.get((v.name, tuple(v.ctx), v.rep)))
    for name, n in skipped.items():
        print(f"hindsight: {name} in run {run}: {n} value(s) that are not numbers left out", file=sys.stderr)
    return RunSeries(run, json.loads(row.args_json or "{}"), x_label, out)


def _differing_args(runs: list[RunSeries]) -> list[str]:
    keys: list[str] = []
    for r in runs:
        keys += [k for k in r.args if k not in keys]
    return [k for k in keys if len({json.dumps(r.args.get(k), sort_keys=True) for r in runs}) > 1]


def plot(runs: list[RunSeries], names: list[str], out: Path) -> None:
    """One panel per name, one line per run (labelled by the arguments that differ)."""
    try:
        import matplotlib
    except ImportError:
        raise InvalidArgumentError("hindsight plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    differ = _differing_args(runs)
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.8 * len(names)), squeeze=False, sharex=True)
    for ax, name in zip(axes[:, 0], names, strict=True):
        for r in runs:
            s = r.series[name]
            label = r.run + "".join(f" {k}={r.args.get(k)}" for k in differ)
            # Markers where points are few (an epoch-level series), lines only where many.
            ax.plot(s.xs, s.ys, "-o" if len(s.xs) <= 60 else "-", label=label, linewidth=1.2, markersize=3)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel(runs[0].x_label)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def tensorboard(runs: list[RunSeries], names: list[str], out: Path) -> list[Path]:
    """One event-file directory per run under `out`; tags are the names, steps the x axis."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise InvalidArgumentError(
            f"hindsight export --tensorboard needs torch and tensorboard: pip install tensorboard ({e})"
        ) from None
    dirs = []
    for r in runs:
        d = out / r.run
        with SummaryWriter(log_dir=str(d)) as w:
            w.add_text("args", "```\n" + json.dumps(r.args, indent=2, sort_keys=True) + "\n```", 0)
            for name in names:
                s = r.series[name]
                for x, y, t in zip(s.xs, s.ys, s.wall_s, strict=True):
                    w.add_scalar(name, y, x, walltime=t)
        dirs.append(d)
    return dirs


def _open(home: str | None) -> tuple[Any, Any]:
    paths = _native.project_paths(str(Path.cwd()), str(Path(home).resolve()) if home else None)
    if not Path(paths.db).exists():
        raise NotFoundError(f"no hindsight project at {paths.home} (no {Path(paths.db).name})")
    return _native.LogDb(str(paths.db), checked=True), paths


def _runs(db: Any, which: list[str]) -> list[str]:
    if which in ([], ["latest"]):
        latest = db.runs(1)
        if not latest:
            raise NotFoundError("no runs recorded in this project yet")
        return [latest[0].id]
    return [db.run(r).id for r in which]  # NotFound names the id


def main(a: _native.SeriesArgs) -> int:
    """`hindsight plot` and `hindsight export`, their arguments parsed by
    the command's one grammar (`hindsight_cli::pycmds`)."""
    command = a.command
    try:
        db, _ = _open(a.home)
        runs = [run_series(db, r, a.names) for r in _runs(db, a.run)]
        if a.output is not None:
            plot(runs, a.names, Path(a.output))
            print(f"wrote {a.output}: {', '.join(a.names)} of {len(runs)} run(s)")
        else:
            assert a.tensorboard is not None  # export's required option
            dirs = tensorboard(runs, a.names, Path(a.tensorboard))
            n = sum(len(r.series[name].xs) for r in runs for name in a.names)
            print(
                f"wrote {n} value(s) of {len(runs)} run(s) under {a.tensorboard}: tensorboard --logdir {a.tensorboard}"
            )
            for d in dirs:
                print(f"  {d}")
    except HindsightError as e:
        print(f"hindsight {command}: error: {e}", file=sys.stderr)
        return 1
    return 0

"""Reading logs back: hs.dataframe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hindsight import _native, _run
from hindsight.errors import NotFoundError


def _db() -> Any:
    if _run._RUN is not None:
        return _run._RUN.db
    paths = _native.project_paths(str(_run._script_path().parent))
    if not Path(paths.db).exists():
        raise NotFoundError(f"no hindsight project at {paths.home} (no {Path(paths.db).name}); record a run first")
    return _native.LogDb(str(paths.db), checked=True)  # answers from a damaged database would be wrong


def dataframe(*names: str, run: str | list[str] | None = None, args: bool = False) -> Any:
    """One pandas row per (run, loop context), one column per loop and per name.
    ``args=True`` adds a column per recorded argument (``hs.arg``/``hs.args``),
    so runs that differ in, say, ``lr`` can be grouped and compared.

    An outer loop over integers other than its positions (``range(1, N)``)
    shows the values it iterated over, and its positions in ``<loop>_idx``.

    A name logged several times in one context keeps every value: the
    context then has one row per occurrence, numbered by a ``rep`` column
    (0 for the first value), in the order they were logged.

    Values written by a replay appear beside the recorded ones in the same
    run; where both exist for a context, the recorded value is shown (the
    engine's rule, the same as ``hindsight logs``; a replay that disagrees
    is reported as a divergence).

    A name that none of the runs logged raises ``NotFoundError`` naming
    the names they did log (a typo is never an empty frame).

    A replayed value is shown only when its replay proved itself: values of
    a replay kept with ``--allow-divergence`` are left out (missing), and
    ``df.attrs["replay_flags"]`` maps ``(run, context, name)`` to the flag
    of each value that is not exact ("inexact": another thread count;
    "diverged": left out).
    """
    import pandas as pd

    db = _db()
    if run is None:
        if _run._RUN is not None:
            runs = [_run._RUN.run_id]
        else:
            latest = db.runs(1)
            if not latest:
                raise NotFoundError("no runs recorded in this project yet")
            runs = [latest[0].id]
    else:
        runs = [run] if isinstance(run, str) else list(run)
    if _run._RUN is not None and _run._RUN.run_id in runs:
        _run._RUN.flush_logs()
    db.require_logged(runs, list(names))  # a mistyped name is an error naming the logged ones
    rows: dict[tuple[str, tuple[tuple[str, int], ...], int], dict[str, Any]] = {}
    loops: list[str] = []
    repeated = False
    flags: dict[tuple[str, tuple[tuple[str, int], ...], str], str] = {}
    for r in runs:
        for v in db.values(r, list(names)):
            for loop, _ in v.ctx:
                if loop not in loops:
                    loops.append(loop)
            repeated = repeated or v.rep > 0
            row = rows.setdefault((r, tuple(v.ctx), v.rep), {"run": r, **dict(v.ctx), "rep": v.rep})
            if v.recorded is None and v.replay_flag is not None:
                flags[(r, tuple(v.ctx), v.name)] = v.replay_flag
                if v.replay_flag == "diverged":
                    continue  # never shown as if it were good
            row[v.name] = json.loads(v.value_json)
    arg_names: list[str] = []
    if args:
        for r in runs:
            recorded = json.loads(db.run(r).args_json or "{}")
            for k in recorded:
                if k not in arg_names:
                    arg_names.append(k)
            for key, row in rows.items():
                if key[0] == r:
                    for k in arg_names:
                        row.setdefault(k, recorded.get(k))
    # Where an outer loop iterated over integers other than its positions
    # (range(1, N)), its column shows those values and `<loop>_idx` the positions.
    for r in runs:
        for loop in db.outer_loops(r):
            values = {it.idx: it.value for it in db.iterations(r, loop) if it.value is not None}
            if all(v == i for i, v in values.items()):
                continue
            if f"{loop}_idx" not in loops:
                loops.insert(loops.index(loop) if loop in loops else 0, f"{loop}_idx")
            for key, row in rows.items():
                if key[0] == r and loop in row:
                    row[f"{loop}_idx"] = row[loop]
                    row[loop] = values.get(row[loop], row[loop])
    order = sorted(rows, key=lambda k: (runs.index(k[0]), [v for _, v in k[1]], len(k[1]), k[2]))
    columns = ["run", *arg_names, *loops, *(["rep"] if repeated else []), *names]
    df = pd.DataFrame([rows[k] for k in order], columns=columns)
    for loop in loops:
        df[loop] = df[loop].astype("Int64")
    df.attrs["replay_flags"] = flags
    return df

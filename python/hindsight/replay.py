"""`hindsight replay`: add log statements to a recorded script, then compute
their values without re-training.

    hindsight replay train.py [--run ID ...] [-j G] [--where "epoch >= 10"] [--force] [--fast] [--allow-divergence]
                              [--recorded-ranks]
                              [--launcher slurm [--sbatch=--partition=P ...]]

New statements outside the inner loops: partial replay (the training steps
are skipped; each probed iteration's state comes from its checkpoint).
New statements inside an inner loop: parallel replay (the probed iterations
are split over G worker processes, each resuming from a checkpoint).
"""

from __future__ import annotations

import ast
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hindsight import _native
from hindsight._analysis import Analysis, analyze, transplant
from hindsight._launch import LaunchContext, Worker, launcher
from hindsight._run import jupyter
from hindsight.errors import HindsightError, NotFoundError, ReplayError

#: Longest --where accepted: a filter longer than this is a mistake, and the
#: parser's recursion would fail on it anyway.
MAX_WHERE = 2000


def _where(expr: str | None, loop: str) -> Any:
    """A restricted predicate over the outer loop's index, e.g. 'epoch >= 10 and epoch % 2 == 0'."""
    if not expr:
        return lambda i: True
    if len(expr) > MAX_WHERE:
        raise ReplayError(f"--where: {len(expr)} characters; a filter of at most {MAX_WHERE} is accepted")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise ReplayError(f"--where {expr!r}: not an expression ({e.msg})") from None
    except (RecursionError, MemoryError):
        raise ReplayError(f"--where: nested too deeply ({expr[:40]}...)") from None
    allowed = (
        ast.Expression,
        ast.BoolOp,
        ast.And,
        ast.Or,
        ast.UnaryOp,
        ast.Not,
        ast.USub,
        ast.Compare,
        ast.Eq,
        ast.NotEq,
        ast.Lt,
        ast.LtE,
        ast.Gt,
        ast.GtE,
        ast.In,
        ast.NotIn,
        ast.BinOp,
        ast.Mod,
        ast.Add,
        ast.Sub,
        ast.Mult,
        ast.FloorDiv,
        ast.Name,
        ast.Load,
        ast.Constant,
        ast.Tuple,
        ast.List,
    )
    for node in ast.walk(tree):
        if not isinstance(node, allowed):
            raise ReplayError(f"--where {expr!r}: only comparisons and arithmetic on '{loop}' are allowed")
        if isinstance(node, ast.Name) and node.id != loop:
            raise ReplayError(f"--where {expr!r}: unknown name '{node.id}' (the outer loop is '{loop}')")
        # Numbers only, and lists/tuples only as the right side of `in`: so
        # no expression can build a large value ('a' * 10**10, [0] * 10**10).
        if isinstance(node, ast.Constant) and not (
            isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
            and abs(node.value) <= _WHERE_MAX_CONSTANT
        ):
            raise ReplayError(f"--where {expr!r}: {node.value!r} is not a number this filter accepts")
        if isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators, strict=True):
                if isinstance(right, (ast.List, ast.Tuple)) and not isinstance(op, (ast.In, ast.NotIn)):
                    raise ReplayError(f"--where {expr!r}: a list can only follow 'in'")
        if isinstance(node, ast.BinOp) and any(isinstance(x, (ast.List, ast.Tuple)) for x in (node.left, node.right)):
            raise ReplayError(f"--where {expr!r}: no arithmetic on lists")
        if isinstance(node, (ast.List, ast.Tuple)) and len(node.elts) > 10_000:
            raise ReplayError(f"--where {expr!r}: list too long")
    code = compile(tree, "<--where>", "eval")

    def pred(i: int) -> bool:
        try:
            return bool(eval(code, {"__builtins__": {}}, {loop: i}))
        except (ArithmeticError, TypeError, ValueError) as e:
            raise ReplayError(f"--where {expr!r} at {loop}={i}: {e}") from None

    return pred


_WHERE_MAX_CONSTANT = 10**12


def _read_script(path: Path) -> str:
    """The script's text; a clear error for bytes that are not UTF-8 or Python.
    A notebook's is its code cells as a script (magics dropped or refused)."""
    if path.suffix == jupyter.SUFFIX:
        return jupyter.script_of(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ReplayError(f"{path}: not UTF-8 text (byte {e.start}); hindsight replays Python source") from None
    try:
        ast.parse(text, str(path))
    except SyntaxError as e:
        raise ReplayError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    return text


@dataclass
class RunJob:
    """A run's planned replay: its workers, and what the report needs."""

    run_id: str
    names: list[str]
    workers: list[Worker]
    total: int
    start_seq: int
    versions: dict[str, Any]
    temp_script: Path | None = None
    replay_id: int = 0
    #: Workers run with the recording's thread count, so values must be equal bit for bit.
    exact: bool = True


def plan_run(
    db: Any,
    location: str,
    store_names: set[str],
    run: _native.RunInfo,
    analysis: Analysis,
    jobs: int,
    where: str | None,
) -> Any:
    """The engine's replay plan of `run` (`hindsight_core::replay`); only `--where`,
    a Python expression, is evaluated here."""
    # The loop that ran outermost, as recorded (the source may hold it in a function).
    recorded = db.outer_loops(run.id)
    if not recorded:
        if not analysis.outer_loops:
            raise ReplayError("the script has no hs.loop: nothing to replay")
        raise ReplayError(f"run {run.id} recorded no iterations of loop '{analysis.outer_loops[0]}'")
    outer = recorded[0]
    # Loops recorded but not in the script are a framework's (Lightning's
    # epochs): probes in its hooks are placed by the hook.
    analysis.framework = not analysis.outer_loops
    rows = db.iterations(run.id, outer)
    n = max(r.idx for r in rows) + 1
    pred = _where(where, outer)
    # The integer the loop iterated over where it was one (epoch 1 of range(1, N)), else the position.
    value = {r.idx: r.value for r in rows if r.value is not None}
    selected = [pred(value.get(i, i)) for i in range(n)]
    if not any(selected):
        raise ReplayError(f"--where {where!r} selects none of the {n} recorded iterations")
    return db.plan_replay(
        run.id,
        outer,
        store_names,
        selected,
        needs_inner=analysis.needs_inner_execution,
        needs_start=analysis.needs_start_state,
        location=location,
        workers=max(1, jobs),
    )


def replay(args: _native.ReplayArgs) -> int:
    script = Path(args.script).resolve()
    if not script.exists():
        raise NotFoundError(f"script not found: {args.script}")
    paths = _native.project_paths(str(script.parent), str(Path(args.home).resolve()) if args.home else None)
    home, db_path = Path(paths.home), Path(paths.db)
    if not db_path.exists():
        raise NotFoundError(f"no hindsight project at {home} (no {db_path.name}): record a run of {args.script} first")
    db = _native.LogDb(str(db_path), checked=True)  # replay must not plan from a damaged database
    # Run rows hold absolute paths; read from where the project is now (it
    # may have been moved or copied: the engine's runs::relocate).
    root = home.parent
    runs = db.select_runs(str(script), str(root), str(home), args.runs, args.run, args.since)
    current = _read_script(script)
    status = 0
    names_at: dict[str, set[str]] = {}
    jobs: list[RunJob] = []
    leases: list[_native.RunLease] = []
    try:
        # Plan every run first: their workers then share one budget (-j).
        for run in runs:
            # Each run's checkpoints are where it wrote them (recorded in logs.db).
            location = run.store or str(paths.store)
            # Held shared until the replay ends: `hindsight rm` refuses to take
            # the run or its checkpoints from under it.
            leases.append(_native.RunLease.share(home, run.id))
            recorded = [it for loop in db.outer_loops(run.id) for it in db.iterations(run.id, loop)]
            # A store that is not there is said once, for its first run.
            first = location if location not in names_at else None
            note = _native.replay_unrestorable(run.id, len(recorded), sum(1 for it in recorded if it.checkpoint), first)
            if note is not None:
                print(note, file=sys.stderr, flush=True)
            if location not in names_at:
                names_at[location] = set(_native.checkpoint_names(location))
            try:
                job = _prepare(args, db, location, names_at[location], run, script, current)
            except HindsightError as e:
                if len(runs) == 1:
                    raise
                print(f"run {run.id}: error: {e}", file=sys.stderr, flush=True)  # the others go on
                status |= 1
                continue
            if job is not None:
                jobs.append(job)
        if not jobs:
            return status
        workers = [w for j in jobs for w in j.workers]
        launch = launcher(args.launcher)
        plan = _threads(args, jobs, launch.local)
        for job in jobs:
            job.replay_id = db.begin_replay(job.run_id, job.exact)
            for w in job.workers:
                w.replay_id = job.replay_id
        start = time.monotonic()
        launch.run(
            workers,
            LaunchContext(home, db, plan.budget, start, bool(args.quiet), list(args.sbatch or []), plan.task_cpus),
        )
        for job in jobs:
            status |= _report(args, db, job, start)
        launch.finish(all(w.returncode == 0 for w in workers))
        return status
    finally:
        for lease in leases:
            lease.release()
        for job in jobs:
            if job.temp_script is not None:
                job.temp_script.unlink(missing_ok=True)


def _threads(args: _native.ReplayArgs, jobs: list[RunJob], local: bool) -> _native.ReplayThreads:
    """Each worker's torch thread count, whether its run's values can be
    compared bit for bit, and how many workers run at once: the engine's
    rule (`runs::replay::driver::threads`); this says what it chose."""
    cores = os.cpu_count() or 1
    wanted = [int(j.versions["torch_threads"]) if j.versions.get("torch_threads") else None for j in jobs]
    ranks = [j.workers[0].ranks if j.workers else 1 for j in jobs]
    plan = _native.replay_threads(
        cores,
        int(args.jobs),
        [len(j.workers) for j in jobs],
        wanted,
        ranks,
        bool(args.fast),
        local,
        [j.run_id for j in jobs],
    )
    for note in plan.notes:
        print(note, file=sys.stderr)
    for job, threads, exact in zip(jobs, plan.threads, plan.exact, strict=True):
        job.exact = exact
        for w in job.workers:
            w.threads = threads
            w.exact = exact
    return plan


def _prepare(
    args: _native.ReplayArgs,
    db: Any,
    location: str,
    store_names: set[str],
    run: _native.RunInfo,
    script: Path,
    current: str,
) -> RunJob | None:
    """The replay plan of one run and its workers' command lines; None when
    there is nothing new to compute."""
    files = db.get_source(run.source_hash)
    recorded = files.get(run.script)
    if recorded is None:
        raise NotFoundError(f"run {run.id} has no recorded source for {run.script}")
    analysis = analyze(recorded, current, run.script)
    to_run, temp = script, None
    if not analysis.compatible and not args.force:
        # Recorded from another version: put the new hs.log statements into
        # that version's own source, where they belong.
        src, problems = transplant(recorded, current, run.script)
        placed = analyze(recorded, src, run.script) if src is not None else None
        if placed is not None and not placed.compatible:
            # Placed, but what was added changes the training it replays.
            diff = "\n".join("  " + line for line in placed.differences[:60])
            raise ReplayError(
                f"the statements added to {run.script} since run {run.id} would change the training "
                f"that replay re-runs, so every value after them would differ:\n{diff}\n"
                "(pass --force to replay the current script anyway)"
            )
        if placed is None:
            diff = "\n".join("  " + line for line in analysis.differences[:60])
            why = "\n".join("  " + p for p in problems)
            raise ReplayError(
                f"{run.script} changed since run {run.id} in ways other than added observing "
                "code, and the new statements cannot all be placed into the recorded version:\n"
                f"{why}\nDifferences:\n{diff}\n(pass --force to replay the current script anyway)"
            )
        analysis = placed
        to_run = temp = script.parent / f".hindsight-replay-{run.id}.py"
        temp.write_text(src or "")
        print(
            f"run {run.id}: recorded from another version of {run.script}; "
            "the new hs.log statements were placed into its recorded source",
            flush=True,
        )
    if not analysis.new_probes:
        print(f"run {run.id}: no new hs.log statements; nothing to compute")
        if temp is not None:
            temp.unlink(missing_ok=True)
        return None
    try:
        plan = plan_run(db, location, store_names, run, analysis, args.jobs, args.where)
    except BaseException:
        if temp is not None:
            temp.unlink(missing_ok=True)
        raise
    if temp is None and script.suffix == jupyter.SUFFIX:
        # A worker runs Python: the notebook's cells as the script analysed,
        # beside the notebook (the same directory, so the same project).
        to_run = temp = script.parent / f".hindsight-replay-{run.id}.py"
        temp.write_text(current)
    names = sorted({p.name for p in analysis.new_probes})
    print(f"run {run.id}: {plan.kind} replay of {', '.join(names)} on {len(plan.workers)} worker(s)", flush=True)
    if plan.note is not None:
        print(plan.note, file=sys.stderr, flush=True)
    versions = json.loads(run.versions_json or "{}")
    # The script as it is now (the one analysed, or the recorded version with
    # the new statements placed into it), run where the recording ran.
    # A worker of a multi-rank run that only restores runs on one process
    # (unless --recorded-ranks).
    workers = []
    for w in plan.workers:
        one = w.restores_only and not args.recorded_ranks
        command = db.worker_command(run.id, run.project_root, str(to_run), sys.executable, one)
        workers.append(
            Worker(w.worker, w.modes, w, run.id, command.argv, command.cwd, command.ranks, torchrun=command.torchrun)
        )
    total = sum(w.visits for w in workers)
    return RunJob(run.id, names, workers, total, db.last_seq(run.id), versions, temp)


def _report(args: _native.ReplayArgs, db: Any, job: RunJob, start: float) -> int:
    """Say how one run's replay ended (core `runs::replay::report`), keep or
    discard its values as the verdict says; its exit status."""
    ends = []
    for w in job.workers:
        iters = sorted(i for i, m in w.modes.items() if m != "skip")
        first, last = (iters[0], iters[-1]) if iters else (None, None)
        ends.append(_native.WorkerEnd(w.index, first, last, w.returncode, w.stderr_tail, w.progress))
    report = _native.replay_report(
        job.run_id,
        job.names,
        job.total,
        ends,
        db.replay_divergences(job.replay_id),
        bool(args.allow_divergence),
        job.exact,
        time.monotonic() - start,
    )
    for text in report.warnings:
        sys.stderr.write(text)
    sys.stderr.flush()
    verdict = report.verdict
    db.finish_replay(job.replay_id, verdict.keep)
    for line in report.summary:
        print(line)
    if not verdict.failed and not verdict.diverged:
        for note in _native.replay_unproduced(job.run_id, job.names, db.log_names(job.run_id)):
            print(note, file=sys.stderr)
    return verdict.exit


def main(args: _native.ReplayArgs) -> int:
    """`hindsight replay`, its arguments parsed by the command's one grammar
    (`hindsight_cli::pycmds::ReplayArgs`)."""
    try:
        return replay(args)
    except HindsightError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

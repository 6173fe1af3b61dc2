"""`hindsight replay`: add log statements to a recorded script, then compute
their values without re-training.

    hindsight replay train.py [--run ID ...] [-j G] [--where "epoch >= 10"] [--force] [--fast] [--allow-divergence]
                              [--launcher slurm [--sbatch=--partition=P ...]]

New statements outside the inner loops: partial replay (the training steps
are skipped; each probed iteration's state comes from its checkpoint).
New statements inside an inner loop: parallel replay (the probed iterations
are split over G worker processes, each resuming from a checkpoint).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import selectors
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hindsight import _native, _settings
from hindsight._analysis import Analysis, analyze, transplant
from hindsight._run import ENV_HOME, ENV_REPLAY, files
from hindsight._run.replay import EXIT_DIVERGED
from hindsight._zygote import Zygote, preload_modules
from hindsight.errors import HindsightError, NotFoundError, ReplayError

#: Longest --where accepted: a filter longer than this is a mistake, and the
#: parser's recursion would fail on it anyway.
MAX_WHERE = 2000
#: Most replay workers at once: far past any machine's cores (a typo otherwise
#: overflows the engine's integer).
MAX_JOBS = 4096


def _jobs(text: str) -> int:
    """`-j N`: a positive worker count."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= n <= MAX_JOBS:
        raise argparse.ArgumentTypeError(f"{n} workers: give 1 to {MAX_JOBS}")
    return n


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
    """The script's text; a clear error for bytes that are not UTF-8 or Python."""
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
class Worker:
    """One worker process of one run's replay."""

    index: int
    modes: dict[int, str]
    plan: Any
    run_id: str = ""
    argv: list[str] = field(default_factory=list)
    cwd: str = ""
    proc: subprocess.Popen[bytes] | None = None
    read_fd: int = -1
    done: int = 0
    steps: int = 0
    restored: int = 0
    returncode: int | None = None
    stderr_tail: str = ""
    # The replay the worker stages its values for, and its torch threads.
    replay_id: int = 0
    threads: int = 1
    #: Runs with the recording's thread count: its state must equal the checkpoints'.
    exact: bool = True
    # Local workers: the tail of standard error read so far, and the pipes
    # (progress, standard error) still open.
    err: bytes = b""
    partial: bytes = b""
    open_pipes: int = 0
    err_fd: int = -1
    zid: int = -1  # the request id of a worker forked by the zygote


@dataclass
class RunJob:
    """A run's planned replay: its workers, and what the report needs."""

    run_id: str
    names: str
    workers: list[Worker]
    total: int
    start_seq: int
    versions: dict[str, Any]
    temp_script: Path | None = None
    replay_id: int = 0
    #: Workers run with the recording's thread count, so values must be equal bit for bit.
    exact: bool = True


def _progress(workers: list[Worker], total: int, start: float, final: bool = False) -> None:
    done = sum(w.done for w in workers)
    width = 30
    filled = int(width * done / max(total, 1))
    per = " ".join(f"w{i}:{w.done}/{sum(1 for m in w.modes.values() if m != 'skip')}" for i, w in enumerate(workers))
    line = f"\rreplay [{'#' * filled}{'-' * (width - filled)}] {done}/{total} iterations  {per}  {time.monotonic() - start:.1f}s"
    if sys.stderr.isatty():
        sys.stderr.write(line + ("\n" if final else ""))
    elif final:
        sys.stderr.write(line.lstrip("\r") + "\n")
    sys.stderr.flush()


def plan_run(
    db: Any, store_names: set[str], run: dict[str, Any], analysis: Analysis, jobs: int, where: str | None
) -> Any:
    """The engine's replay plan of `run` (`hindsight_core::replay`); only `--where`,
    a Python expression, is evaluated here."""
    # The loop that ran outermost, as recorded (the source may hold it in a function).
    recorded = db.outer_loops(run["id"])
    if not recorded:
        if not analysis.outer_loops:
            raise ReplayError("the script has no hs.loop: nothing to replay")
        raise ReplayError(f"run {run['id']} recorded no iterations of loop '{analysis.outer_loops[0]}'")
    outer = recorded[0]
    # Loops recorded but not in the script are a framework's (Lightning's
    # epochs): probes in its hooks are placed by the hook.
    analysis.framework = not analysis.outer_loops
    rows = db.iterations(run["id"], outer)
    n = max(r.idx for r in rows) + 1
    pred = _where(where, outer)
    # The integer the loop iterated over where it was one (epoch 1 of range(1, N)), else the position.
    value = {r.idx: r.value for r in rows if r.value is not None}
    selected = [pred(value.get(i, i)) for i in range(n)]
    if not any(selected):
        raise ReplayError(f"--where {where!r} selects none of the {n} recorded iterations")
    return db.plan_replay(
        run["id"],
        outer,
        store_names,
        selected,
        analysis.needs_inner_execution,
        analysis.needs_start_state,
        max(1, jobs),
    )


def replay(args: argparse.Namespace) -> int:
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
    try:
        # Plan every run first: their workers then share one budget (-j).
        for run in runs:
            # Each run's checkpoints are where it wrote them (recorded in logs.db).
            location = run.get("store") or str(paths.store)
            if location not in names_at and "://" not in location and not Path(location).is_dir():
                print(
                    f"note: run {run['id']}: its checkpoint store is not at {location} (removed, or a store outside "
                    "a project that moved): every iteration is re-executed, none restored from or checked against "
                    "a checkpoint",
                    file=sys.stderr,
                    flush=True,
                )
            if location not in names_at:
                names_at[location] = set(_native.checkpoint_names(location))
            try:
                job = _prepare(args, db, names_at[location], run, script, current)
            except HindsightError as e:
                if len(runs) == 1:
                    raise
                print(f"run {run['id']}: error: {e}", file=sys.stderr, flush=True)  # the others go on
                status |= 1
                continue
            if job is not None:
                jobs.append(job)
        if not jobs:
            return status
        workers = [w for j in jobs for w in j.workers]
        budget = _threads(args, jobs)
        for job in jobs:
            job.replay_id = db.begin_replay(job.run_id, job.exact)
            for w in job.workers:
                w.replay_id = job.replay_id
        start = time.monotonic()
        spool = None
        if args.launcher == "slurm":
            spool = _run_slurm(args, db, workers, home, start)
        else:
            _run_local(args, workers, home, budget, start)
        for job in jobs:
            status |= _report(args, db, job, start)
        if spool is not None:
            if any(w.returncode != 0 for w in workers):
                print(f"the Slurm tasks' files are kept in {spool}", file=sys.stderr)
            else:
                shutil.rmtree(spool, ignore_errors=True)
        return status
    finally:
        for job in jobs:
            if job.temp_script is not None:
                job.temp_script.unlink(missing_ok=True)


def _threads(args: argparse.Namespace, jobs: list[RunJob]) -> int:
    """Each worker's torch thread count, whether its run's values can be
    compared bit for bit, and how many local workers run at once.

    Exactness needs the recording's thread count (reductions round by how
    they are split). So by default every worker runs with it, and -j is
    capped so that workers x threads <= cores; `--fast` instead gives each
    worker cores // workers threads, and the values are compared with a
    tolerance and stored marked inexact."""
    cores = os.cpu_count() or 1
    budget = max(1, min(int(args.jobs), sum(len(j.workers) for j in jobs)))
    if args.launcher == "slurm":
        budget = int(args.jobs)
    recorded = [int(j.versions["torch_threads"]) for j in jobs if j.versions.get("torch_threads")]
    if not args.fast and recorded and args.launcher == "local":
        widest = max(recorded)
        capped = max(1, cores // widest)
        if capped < budget:
            print(
                f"note: -j {args.jobs} runs {capped} worker(s) at a time: each uses the recording's {widest} "
                f"torch thread(s) so that values replay exactly, and this machine has {cores} cores "
                "(--fast runs more, with values that may differ in the last bits)",
                file=sys.stderr,
            )
            budget = capped
    fair = max(1, cores // budget)
    for job in jobs:
        want = job.versions.get("torch_threads")
        threads = int(want) if want and not args.fast else fair
        job.exact = not want or threads == int(want)
        if not job.exact:
            print(
                f"note: run {job.run_id}: each worker uses {threads} thread(s), the recording used {want}: "
                "values may differ in the last bits; they are compared within a tolerance and kept marked "
                "'inexact' (an exact value an earlier replay computed is never replaced)",
                file=sys.stderr,
            )
        for w in job.workers:
            w.threads = threads
            w.exact = job.exact
    return budget


def _prepare(
    args: argparse.Namespace,
    db: Any,
    store_names: set[str],
    run: dict[str, Any],
    script: Path,
    current: str,
) -> RunJob | None:
    """The replay plan of one run and its workers' command lines; None when
    there is nothing new to compute."""
    files = db.get_source(run["source_hash"])
    recorded = files.get(run["script"])
    if recorded is None:
        raise NotFoundError(f"run {run['id']} has no recorded source for {run['script']}")
    analysis = analyze(recorded, current, run["script"])
    to_run, temp = script, None
    if not analysis.compatible and not args.force:
        # Recorded from another version: put the new hs.log statements into
        # that version's own source, where they belong.
        src, problems = transplant(recorded, current, run["script"])
        placed = analyze(recorded, src, run["script"]) if src is not None else None
        if placed is not None and not placed.compatible:
            # Placed, but what was added changes the training it replays.
            diff = "\n".join("  " + line for line in placed.differences[:60])
            raise ReplayError(
                f"the statements added to {run['script']} since run {run['id']} would change the training "
                f"that replay re-runs, so every value after them would differ:\n{diff}\n"
                "(pass --force to replay the current script anyway)"
            )
        if placed is None:
            diff = "\n".join("  " + line for line in analysis.differences[:60])
            why = "\n".join("  " + p for p in problems)
            raise ReplayError(
                f"{run['script']} changed since run {run['id']} in ways other than added observing "
                "code, and the new statements cannot all be placed into the recorded version:\n"
                f"{why}\nDifferences:\n{diff}\n(pass --force to replay the current script anyway)"
            )
        analysis = placed
        to_run = temp = script.parent / f".hindsight-replay-{run['id']}.py"
        temp.write_text(src or "")
        print(
            f"run {run['id']}: recorded from another version of {run['script']}; "
            "the new hs.log statements were placed into its recorded source",
            flush=True,
        )
    if not analysis.new_probes:
        print(f"run {run['id']}: no new hs.log statements; nothing to compute")
        if temp is not None:
            temp.unlink(missing_ok=True)
        return None
    try:
        plan = plan_run(db, store_names, run, analysis, args.jobs, args.where)
    except BaseException:
        if temp is not None:
            temp.unlink(missing_ok=True)
        raise
    names = ", ".join(sorted({p.name for p in analysis.new_probes}))
    print(f"run {run['id']}: {plan.kind} replay of {names} on {len(plan.workers)} worker(s)", flush=True)
    versions = json.loads(run["versions_json"] or "{}")
    argv = versions.get("argv") or [run["script_abs"]]
    cwd = (
        versions.get("cwd")
        if versions.get("cwd") and Path(versions["cwd"]).is_dir()
        else str(script.parent)  # the recorded directory is gone: the script's, as it is now
    )
    # The script as it is now (the one analysed), which may be a copy of the
    # recorded one elsewhere, run in the recorded directory.
    worker_argv = [sys.executable, str(to_run), *argv[1:]]
    workers = [Worker(w.worker, w.modes, w, run["id"], worker_argv, cwd) for w in plan.workers]
    total = sum(sum(1 for m in w.modes.values() if m != "skip") for w in workers)
    return RunJob(run["id"], names, workers, total, db.last_seq(run["id"]), versions, temp)


def _report(args: argparse.Namespace, db: Any, job: RunJob, start: float) -> int:
    """Failures, divergences and the summary of one run's replay; its exit status."""
    failed = [w for w in job.workers if w.returncode not in (0, EXIT_DIVERGED)]
    for w in failed:
        iters = sorted(i for i, m in w.modes.items() if m != "skip")
        print(
            f"run {job.run_id}: worker {w.index} (iterations {iters[0]}..{iters[-1]}) failed with exit code "
            f"{w.returncode}; the values of finished iterations are kept:\n{w.stderr_tail}",
            file=sys.stderr,
        )
    for w in job.workers:
        if w.returncode in (0, EXIT_DIVERGED) and w.stderr_tail.strip():
            sys.stderr.write(w.stderr_tail)
    # Judge what this replay staged against the recording: a replay that
    # computed a recorded value differently computed its new ones on wrong
    # state too, so they are not presented as results.
    divergences = db.replay_divergences(job.replay_id).divergences
    if divergences:
        first = divergences[0]
        where = ", ".join(f"{k}={v}" for k, v in first.ctx) or "top level"
        kept = "kept, marked 'diverged'" if args.allow_divergence else "discarded"
        print(
            f"DIVERGENCE in run {job.run_id}: {len(divergences)} value(s) differ between record and replay; "
            f"first: {first.name} at {where}: recorded {first.record_value}, replayed {first.replay_value}. "
            f"The replay's values were {kept}"
            + ("" if args.allow_divergence else " (--allow-divergence keeps them, marked)"),
            file=sys.stderr,
        )
    diverged = bool(divergences) or any(w.returncode == EXIT_DIVERGED for w in job.workers)
    if diverged and not args.allow_divergence:
        db.finish_replay(job.replay_id, None)
    else:
        db.finish_replay(job.replay_id, "diverged" if diverged else "exact" if job.exact else "inexact")
    steps = sum(w.steps for w in job.workers)
    restored = sum(w.restored for w in job.workers)
    print(
        f"replayed {job.total} iteration(s) in {time.monotonic() - start:.1f}s: {restored} restored from "
        f"checkpoints, {steps} inner-loop steps executed; new values: {job.names}"
    )
    if not failed and not diverged:
        # Nothing is no wrong value, but it must not pass unnoticed.
        have = set(db.log_names(job.run_id))
        for name in (n for n in job.names.split(", ") if n and n not in have):
            print(
                f"note: run {job.run_id}: the replay produced no value of {name!r}: its line did not run in "
                "the replayed iterations (a condition that never held, or --where left them out)",
                file=sys.stderr,
            )
    if diverged and not args.allow_divergence:
        return EXIT_DIVERGED
    if failed:
        return 1
    return 0


def _run_local(
    args: argparse.Namespace,
    workers: list[Worker],
    home: Path,
    budget: int,
    start: float,
) -> None:
    """Workers as processes of this machine, writing into the project's
    logs.db: at most `budget` at a time, over all runs' workers."""
    total = sum(sum(1 for m in w.modes.values() if m != "skip") for w in workers)
    sel = selectors.DefaultSelector()
    waiting = list(workers)
    running = 0

    def thread_env(n: int) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)}

    zygote = _start_zygote(workers, {**os.environ, **thread_env(workers[0].threads)}) if len(workers) >= 2 else None
    with tempfile.TemporaryDirectory(prefix="hindsight-replay-") as tmp:

        def launch(n: int, w: Worker) -> None:
            r, wfd = os.pipe()
            plan_path = Path(tmp) / f"worker-{n}.json"
            plan_path.write_text(
                w.plan.to_json(wfd, None, w.replay_id, w.exact)
            )  # the worker protocol: hindsight_core::replay
            # Its own working directory: files the script writes are its own (files.py).
            own = Path(tmp) / f"cwd-{n}"
            files.mirror(Path(w.cwd), own)
            env = {
                **os.environ,
                ENV_REPLAY: str(plan_path),
                ENV_HOME: str(home),
                files.ENV_RECORDED_CWD: w.cwd,
                files.ENV_CONCURRENT: "1" if budget > 1 and len(workers) > 1 else "0",
                **thread_env(w.threads),
            }
            if zygote is not None:
                er, ew = os.pipe()
                out = os.open(os.devnull, os.O_WRONLY) if args.quiet else os.dup(1)
                try:
                    w.zid = zygote.fork(w.argv, str(own), env, (out, ew, wfd), w.threads)
                finally:
                    os.close(out)
                    os.close(ew)
                w.err_fd = er
            else:
                w.proc = subprocess.Popen(
                    w.argv,
                    cwd=own,
                    env=env,
                    pass_fds=(wfd,),
                    stdout=subprocess.DEVNULL if args.quiet else None,
                    stderr=subprocess.PIPE,
                )
                assert w.proc.stderr is not None
                w.err_fd = w.proc.stderr.fileno()
            os.close(wfd)
            w.read_fd = r
            # Standard error is read as it comes, beside the progress pipe:
            # a worker that writes more than a pipe holds (64 KiB) would
            # otherwise block on it, and the replay with it.
            for fd in (r, w.err_fd):
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ, w)
            w.open_pipes = 2

        try:
            launched = 0
            while waiting or running:
                while waiting and running < budget:
                    launch(launched, waiting.pop(0))
                    launched += 1
                    running += 1
                for key, _ in sel.select(timeout=0.5):
                    w = key.data
                    chunk = os.read(key.fd, 65536)
                    if chunk and key.fd == w.read_fd:
                        # Whole lines only: a read may end inside one.
                        w.partial += chunk
                        done, _, w.partial = w.partial.rpartition(b"\n")
                        _progress_lines(w, done.decode())
                        continue
                    if chunk:
                        w.err = (w.err + chunk)[-_STDERR_KEPT:]
                        continue
                    sel.unregister(key.fd)
                    if w.proc is not None and key.fd == w.err_fd:
                        assert w.proc.stderr is not None
                        w.proc.stderr.close()
                    else:
                        os.close(key.fd)
                    w.open_pipes -= 1
                    if w.open_pipes == 0:
                        w.returncode = w.proc.wait() if w.proc is not None else zygote.wait(w.zid)  # type: ignore[union-attr]
                        w.stderr_tail = w.err.decode(errors="replace")[-2000:]
                        running -= 1
                _progress(workers, total, start)
        finally:
            if zygote is not None:
                if running:
                    zygote.kill()
                zygote.close()
        _progress(workers, total, start, final=True)


def _start_zygote(workers: list[Worker], env: dict[str, str]) -> Zygote | None:
    """The process the workers are forked from (`hindsight._zygote`), having
    imported the heavy libraries their scripts import; None where it cannot
    run (no fork, or $HINDSIGHT_REPLAY_FORK=0): workers then start afresh."""
    if not _settings.flag(_settings.REPLAY_FORK, True) or not hasattr(os, "fork"):
        return None
    modules: list[str] = []
    for script in {w.argv[1] for w in workers if len(w.argv) > 1}:
        try:
            source = Path(script).read_text()
        except (OSError, UnicodeDecodeError):
            continue
        modules += [m for m in preload_modules(source) if m not in modules]
    try:
        return Zygote(modules, env)
    except OSError as e:
        print(f"note: replay workers start afresh ({e})", file=sys.stderr)
        return None


# Bytes of a local worker's standard error kept for the report.
_STDERR_KEPT = 16384


def _progress_lines(w: Worker, text: str) -> None:
    """Count a worker's progress lines (the protocol of hindsight_core::replay)."""
    for line in text.splitlines():
        if line.startswith("steps "):
            parts = line.split()
            w.steps, w.restored = int(parts[1]), int(parts[3])
        elif line.strip():
            w.done += 1


# A task whose job left the queue without writing its exit status: how long
# to wait for the file to appear (a shared file system may show it late).
_SLURM_GRACE_S = 15.0


def _run_slurm(args: argparse.Namespace, db: Any, workers: list[Worker], home: Path, start: float) -> Path:
    """The workers (of every run) as one Slurm job array, followed to its end.
    Each task writes its values into a database of its own in the spool
    directory (under the project home, which the nodes must see); they are
    merged into logs.db as tasks finish, so no SQLite file is shared over
    the network."""
    spool = home / "replay" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    spool.mkdir(parents=True)
    q = shlex.quote
    for i, w in enumerate(workers):
        task = spool / f"task-{i}"
        own = spool / f"cwd-{i}"  # the task's own working directory (files.py)
        files.mirror(Path(w.cwd), own)
        db.export_run(w.run_id, f"{task}.db")
        # fd 3: the task's progress file, opened by its script.
        Path(f"{task}.json").write_text(w.plan.to_json(3, f"{task}.db", w.replay_id, w.exact))
        Path(f"{task}.sh").write_text(
            "\n".join(
                [
                    f"# hindsight replay of run {w.run_id}, worker {w.index}",
                    f"cd {q(str(own))} || exit 1",
                    f"export {files.ENV_RECORDED_CWD}={q(w.cwd)} {files.ENV_CONCURRENT}={int(len(workers) > 1)}",
                    f"export OMP_NUM_THREADS={w.threads} MKL_NUM_THREADS={w.threads}",
                    f"export {ENV_REPLAY}={q(str(task))}.json {ENV_HOME}={q(str(home))}",
                    f"exec 3>>{q(str(task))}.progress",
                    " ".join(q(a) for a in w.argv),
                    # The status file appears whole (rename), or not at all.
                    f"echo $? > {q(str(task))}.rc.tmp && mv {q(str(task))}.rc.tmp {q(str(task))}.rc",
                    "",
                ]
            )
        )
    (spool / "replay.sbatch").write_text(
        f'#!/bin/bash\n# hindsight replay: one task per worker plan\nexec bash {q(str(spool))}/task-"$SLURM_ARRAY_TASK_ID".sh\n'
    )
    runs = sorted({w.run_id for w in workers})
    cmd = [
        "sbatch",
        "--parsable",
        f"--array=0-{len(workers) - 1}",
        f"--job-name=hindsight-replay-{runs[0]}" + (f"+{len(runs) - 1}" if len(runs) > 1 else ""),
        f"--output={spool}/task-%a.out",
        # The recording's thread count, so values replay exactly.
        f"--cpus-per-task={max(w.threads for w in workers)}",
        *(args.sbatch or []),
        str(spool / "replay.sbatch"),
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ReplayError(f"--launcher slurm: could not run sbatch: {e}") from None
    if out.returncode != 0:
        raise ReplayError(f"--launcher slurm: sbatch failed ({out.returncode}): {out.stderr.strip()}")
    job = out.stdout.strip().split(";")[0]
    print(f"Slurm job array {job}, {len(workers)} task(s) for {len(runs)} run(s); files in {spool}", flush=True)
    total = sum(sum(1 for m in w.modes.values() if m != "skip") for w in workers)
    pending = dict(enumerate(workers))
    gone_since: float | None = None
    try:
        while pending:
            for i, w in list(pending.items()):
                progress = spool / f"task-{i}.progress"
                if progress.exists():
                    w.done = 0
                    _progress_lines(w, progress.read_text())
                rc = spool / f"task-{i}.rc"
                if rc.exists():
                    w.returncode = int(rc.read_text().strip() or 1)
                    _finish_task(db, spool, i, w)
                    del pending[i]
            if pending and not _slurm_job_queued(job):
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > _SLURM_GRACE_S:
                    for i, w in pending.items():  # cancelled, timed out, node lost
                        w.returncode = -1
                        _finish_task(db, spool, i, w)
                    pending.clear()
            _progress(workers, total, start)
            if pending:
                time.sleep(0.5)
    except KeyboardInterrupt:
        subprocess.run(["scancel", job], timeout=60, check=False)
        raise
    _progress(workers, total, start, final=True)
    return spool


def _finish_task(db: Any, spool: Path, i: int, w: Worker) -> None:
    """Merge a finished task's values (also a failed one's: its finished
    iterations are kept, as with local workers) and keep its output's tail."""
    out = spool / f"task-{i}.out"
    w.stderr_tail = out.read_text(errors="replace")[-2000:] if out.exists() else ""
    if w.returncode != 0 and not w.stderr_tail:
        w.stderr_tail = f"(no output; the task ended without an exit status: see `scontrol show job` or {out})"
    try:
        db.import_replay(w.run_id, spool / f"task-{i}.db", w.replay_id)
    except HindsightError as e:
        w.returncode = w.returncode or 1
        w.stderr_tail += f"\nits values could not be merged: {e}"


def _slurm_job_queued(job: str) -> bool:
    """Whether any task of the job is still pending or running."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return True  # a busy controller is no evidence that the job ended
    return bool(out.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="hindsight replay", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("script", help="the training script, with new hs.log statements")
    p.add_argument("--run", action="append", help="run id to replay (repeatable; default: the latest run of SCRIPT)")
    p.add_argument(
        "--runs",
        nargs="+",
        metavar="all|ID",
        help="several runs: 'all' recorded runs of SCRIPT, or these ids; runs recorded from another version "
        "of the script get the new statements placed into their own recorded source",
    )
    p.add_argument("--since", metavar="DATE", help="only runs started at or after DATE (UTC: YYYY-MM-DD[ HH:MM])")
    p.add_argument("-j", "--jobs", type=_jobs, default=1, help="worker processes for inner-loop probes")
    p.add_argument("--where", help="only these outer iterations, e.g. 'epoch >= 10'")
    p.add_argument("--force", action="store_true", help="replay even if the script changed beyond logging")
    p.add_argument(
        "--allow-divergence",
        action="store_true",
        help="keep the values of a replay whose recomputed values differ from the recorded ones "
        "(marked 'diverged'; by default they are discarded and the replay exits 3)",
    )
    p.add_argument(
        "--fast",
        action="store_true",
        help="run -j workers at once with cores/j threads each, even where the recording used more threads: "
        "values may differ in the last bits (compared within a tolerance, kept marked 'inexact')",
    )
    p.add_argument("--strict", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    p.add_argument("--home", help="project home (default: $HINDSIGHT_HOME or <git root>/.hindsight)")
    p.add_argument("-q", "--quiet", action="store_true", help="hide the workers' standard output")
    p.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="where the workers run: processes here, or a Slurm job array (one task per worker; "
        "the project home and the store must be visible to the nodes)",
    )
    p.add_argument(
        "--sbatch",
        action="append",
        metavar="ARG",
        help="an option for sbatch with --launcher slurm, e.g. --sbatch=--partition=gpu (repeatable)",
    )
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("-j must be at least 1")
    try:
        return replay(args)
    except HindsightError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())

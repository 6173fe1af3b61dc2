"""The ``slurm`` launcher: the workers as one Slurm job array."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hindsight import _native
from hindsight._launch import LaunchContext, Worker, progress, progress_lines, stderr_tail
from hindsight._run import ENV_HOME, ENV_REPLAY, files
from hindsight.errors import HindsightError, ReplayError

# A task whose job left the queue without writing its exit status: how long
# to wait for the file to appear (a shared file system may show it late).
_SLURM_GRACE_S = 15.0


class SlurmLauncher:
    """The workers (of every run) as one Slurm job array, followed to its end.
    A worker of a multi-rank run is a torchrun job of its ranks inside its
    task (its command line says so: core `worker_command`), on one node.
    Each task writes its values into a database of its own in the spool
    directory (under the project home, which the nodes must see); they are
    merged into logs.db as tasks finish, so no SQLite file is shared over
    the network."""

    local = False

    def __init__(self) -> None:
        self.spool: Path | None = None

    def run(self, workers: list[Worker], ctx: LaunchContext) -> None:
        self.spool = _run(workers, ctx)

    def finish(self, ok: bool) -> None:
        if self.spool is None:
            return
        if ok:
            shutil.rmtree(self.spool, ignore_errors=True)
        else:
            print(f"the Slurm tasks' files are kept in {self.spool}", file=sys.stderr)


def _run(workers: list[Worker], ctx: LaunchContext) -> Path:
    home, db, start = ctx.home, ctx.db, ctx.start
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
        # The recording's thread count, so values replay exactly, for each
        # rank of a multi-rank run's worker (a torchrun job on the task's node).
        f"--cpus-per-task={ctx.task_cpus}",
        *ctx.options,
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
    total = sum(w.visits for w in workers)
    pending = dict(enumerate(workers))
    gone_since: float | None = None
    try:
        while pending:
            for i, w in list(pending.items()):
                lines = spool / f"task-{i}.progress"
                if lines.exists():
                    w.progress = _native.Progress()  # the whole file is read again
                    progress_lines(w, lines.read_text())
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
            progress(workers, total, start)
            if pending:
                time.sleep(0.5)
    except KeyboardInterrupt:
        subprocess.run(["scancel", job], timeout=60, check=False)
        raise
    progress(workers, total, start, final=True)
    return spool


def _finish_task(db: Any, spool: Path, i: int, w: Worker) -> None:
    """Merge a finished task's values (also a failed one's: its finished
    iterations are kept, as with local workers) and keep its output's tail."""
    out = spool / f"task-{i}.out"
    w.stderr_tail = stderr_tail(out.read_text(errors="replace")) if out.exists() else ""
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

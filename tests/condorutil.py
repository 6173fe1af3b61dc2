"""A stand-in for HTCondor's schedd and starter, for the submit-file examples.

No HTCondor pool can be installed from the package registries the tests
reach (Debian has no HTCondor; PyPI's `htcondor` wheel is only the Python
bindings), so this does, in one process, what a pool does with a
checkpointing vanilla-universe job:

- each attempt runs in a fresh scratch directory (another execute node),
  given `transfer_input_files` from the submit directory and whatever the
  last checkpoint exit left in the job's spool;
- the job's environment holds the submit file's `environment` and
  `_CONDOR_JOB_AD`, a job ad file with `CheckpointExitCode`;
- an eviction sends `kill_sig`, waits for the job to exit, and queues it
  again;
- an exit with `checkpoint_exit_code` is a checkpoint, not the end: the job
  is queued again too;
- before a job is queued again, its `transfer_checkpoint_files` (else its
  `transfer_output_files`, as `when_to_transfer_output = ON_EXIT_OR_EVICT`
  does) go to the job's spool;
- any other exit ends the job: `transfer_output_files` go back to the submit
  directory, and the stand-in returns the exit code.

A file named in `transfer_input_files` that does not exist puts the job on
hold, as HTCondor does: here, an error naming it.
"""

from __future__ import annotations

import shlex
import shutil
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


def parse_submit(text: str) -> dict[str, str]:
    """`key = value` lines up to `queue`; keys lower-cased, `+Attr` kept with its `+`."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.lower().startswith("queue"):
            break
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"submit file line without '=': {raw!r}")
        out[key.strip().lower()] = value.strip()
    return out


def _files(value: str | None) -> list[str]:
    return [f.strip() for f in (value or "").split(",") if f.strip()]


def _environment(value: str | None) -> dict[str, str]:
    """The new syntax: `"A=1 B='two words'"`."""
    if not value:
        return {}
    text = value.strip()
    if text.startswith('"') and text.endswith('"'):
        text = text[1:-1]
    return dict(item.split("=", 1) for item in shlex.split(text))


def _copy(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True, symlinks=True)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


@dataclass
class Attempt:
    """One run of the job on an execute node."""

    scratch: Path
    exit_code: int
    evicted: bool
    stdout: str


@dataclass
class Job:
    submit_dir: Path
    ad: dict[str, str]
    work: Path  # the stand-in's own directory: spool and scratch directories
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def checkpoint_exit_code(self) -> int | None:
        v = self.ad.get("checkpoint_exit_code")
        return int(v) if v else None

    def _scratch(self) -> Path:
        d = self.work / f"execute-{len(self.attempts)}"
        d.mkdir(parents=True)
        for name in _files(self.ad.get("transfer_input_files")):
            src = self.submit_dir / name
            if not src.exists():
                raise FileNotFoundError(
                    f"job held: transfer_input_files names {name}, which does not exist in {self.submit_dir}"
                )
            _copy(src, d / Path(name).name)
        spool = self.work / "spool"
        if spool.exists():
            _copy(spool, d)
        return d

    def run_once(self, evict: Callable[[str], bool] | None, env: dict[str, str]) -> Attempt:
        """One attempt; `evict(line)` is asked after each line the job prints
        and sends `kill_sig` the first time it answers True."""
        scratch = self._scratch()
        job_ad = self.work / f"job-ad-{len(self.attempts)}"
        lines = ["ClusterId = 1", "ProcId = 0", f"JobRunCount = {len(self.attempts) + 1}"]
        if self.checkpoint_exit_code is not None:
            lines.append(f"CheckpointExitCode = {self.checkpoint_exit_code}")
        job_ad.write_text("\n".join(lines) + "\n")
        full_env = {**env, **_environment(self.ad.get("environment")), "_CONDOR_JOB_AD": str(job_ad)}
        full_env["_CONDOR_SCRATCH_DIR"] = str(scratch)
        argv = [self.ad["executable"], *shlex.split(self.ad.get("arguments", ""))]
        kill = getattr(signal, self.ad.get("kill_sig", "SIGTERM").upper())
        out, evicted = [], False
        with subprocess.Popen(
            argv, cwd=scratch, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as p:
            assert p.stdout is not None
            for line in p.stdout:
                out.append(line)
                if not evicted and evict is not None and evict(line):
                    p.send_signal(kill)
                    evicted = True
            code = p.wait(timeout=600)
        attempt = Attempt(scratch, code, evicted, "".join(out))
        self.attempts.append(attempt)
        return attempt

    def transfer(self, names: list[str], scratch: Path, to: Path) -> None:
        for name in names:
            src = scratch / name
            if src.exists():
                _copy(src, to / name)


def run_job(
    submit_file: Path,
    work: Path,
    *,
    submit_dir: Path,
    evictions: list[Callable[[str], bool]],
    env: dict[str, str],
    max_attempts: int = 10,
    overrides: dict[str, str] | None = None,
) -> Job:
    """Submit `submit_file` from `submit_dir` and run it to its end: the
    n-th attempt is evicted where `evictions[n]` says (none after them)."""
    ad = {**parse_submit(submit_file.read_text()), **(overrides or {})}
    job = Job(submit_dir, ad, work)
    ckpt_code = job.checkpoint_exit_code
    carried = _files(ad.get("transfer_checkpoint_files")) or _files(ad.get("transfer_output_files"))
    while len(job.attempts) < max_attempts:
        n = len(job.attempts)
        attempt = job.run_once(evictions[n] if n < len(evictions) else None, env)
        if attempt.evicted or (ckpt_code is not None and attempt.exit_code == ckpt_code):
            job.transfer(carried, attempt.scratch, work / "spool")
            continue  # requeued
        job.transfer(_files(ad.get("transfer_output_files")), attempt.scratch, submit_dir)
        return job
    raise RuntimeError(f"job did not finish in {max_attempts} attempts")

"""What every benchmark shares: timing, machine description, CPU accounting
and the result table (`make bench` runs them all; each prints one table
measured in one run, hindsight against the named competitor)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
GiB = 1 << 30


def now() -> float:
    return time.perf_counter()


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def fmt_b(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= GiB:
        return f"{x / GiB:.3f} GiB"
    return f"{x / MiB:.1f} MiB"


def machine_info(out_dir: Path | None = None) -> dict[str, Any]:
    """CPU, cores, RAM, torch, Python, kernel, git revision, and the file
    system of ``out_dir`` when given."""
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    fs = None
    if out_dir is not None:
        try:
            df = subprocess.run(["df", "-T", str(out_dir)], capture_output=True, text=True, check=True)
            cols = df.stdout.splitlines()[-1].split()
            fs = f"{cols[1]} on {cols[0]} (mounted at {cols[-1]})"
        except (OSError, subprocess.CalledProcessError, IndexError):
            fs = "unknown"
    try:
        git = ["git", "-C", str(REPO)]
        rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True
        )
        revision = rev.stdout.strip() + (" (+ uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        revision = "unknown"
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        cap = "?"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_bytes": ram,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": cap,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "filesystem": fs,
        "git": revision,
    }


def cpu_snapshot() -> tuple[float, float, float]:
    """(CPU-seconds busy on the whole machine, stolen by the hypervisor, used by this process and children)."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    return (user + nice + system + irq + softirq) / tick, steal / tick, own


class Table:
    """metric | hindsight | baseline | ratio | target, with section rows."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def section(self, title: str) -> None:
        self.rows.append({"section": title})

    def add(
        self,
        metric: str,
        hs: float | None,
        base: float | None,
        *,
        unit: str = "s",
        ratio: float | None = None,
        target: float | None = None,
        higher_is_better: bool = False,
        note: str = "",
    ) -> None:
        if ratio is None and hs is not None and base:
            ratio = hs / base
        verdict = note
        if target is not None and ratio is not None:
            good = ratio >= target if higher_is_better else ratio <= target
            verdict = f"{'>=' if higher_is_better else '<='} {target:.3g} {'ok' if good else 'MISS'}"
            if note:
                verdict += f" ({note})"
        self.rows.append(
            {
                "metric": metric,
                "hindsight": hs,
                "baseline": base,
                "unit": unit,
                "ratio": ratio,
                "target": target,
                "verdict": verdict,
            }
        )

    def render(self, headers: tuple[str, ...] = ("metric", "hindsight", "baseline", "ratio", "target")) -> str:
        fmt = {
            "s": fmt_s,
            "B": fmt_b,
            "ns": lambda v: "-" if v is None else f"{v:.0f} ns",
            "us": lambda v: "-" if v is None else f"{v:.1f} us",
            "x": lambda v: "-" if v is None else f"{v:.3f}",
            "MiB": lambda v: "-" if v is None else f"{v:.1f} MiB",
        }
        body: list[list[str] | str] = []
        for r in self.rows:
            if "section" in r:
                body.append(r["section"])
                continue
            f = fmt[r["unit"]]
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
            body.append([r["metric"], f(r["hindsight"]), f(r["baseline"]), ratio, r["verdict"]])
        cells = [list(headers)] + [b for b in body if isinstance(b, list)]
        w = [max(len(c[i]) for c in cells) for i in range(len(headers))]
        total = sum(w) + 3 * (len(w) - 1)

        def line(c: list[str]) -> str:
            return " | ".join(
                c[i].ljust(w[i]) if i in (0, len(c) - 1) else c[i].rjust(w[i]) for i in range(len(c))
            ).rstrip()

        out = [line(list(headers)), "-" * total]
        for b in body:
            out.append(("-- " + b + " ").ljust(total, "-") if isinstance(b, str) else line(b))
        return "\n".join(out)


# --------------------------------------------------------------------------
# child processes


def snapshot_package(pkg: Path) -> dict[str, Any]:
    """Copy the package (with the extension as built now) into ``pkg`` for every child process, so that a
    rebuild of the editable install while the benchmark runs cannot change what is measured."""
    from hindsight import _native

    src = Path(_native.__file__).resolve().parent
    shutil.copytree(src, pkg / "hindsight", ignore=shutil.ignore_patterns("__pycache__"))
    so = Path(_native.__file__).resolve()
    st = so.stat()
    return {
        "extension": str(so.relative_to(REPO)) if so.is_relative_to(REPO) else str(so),
        "extension_bytes": st.st_size,
        "extension_mtime": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.st_mtime)),
    }


def child_env(pkg: Path, **extra: str) -> dict[str, str]:
    """The environment of a child: no HINDSIGHT_* settings of the caller, the package snapshot first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HINDSIGHT_") and k != "BENCH_TIMES"}
    env["PYTHONPATH"] = str(pkg) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path, env: dict[str, str], what: str, ok: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """Run a command, timing the whole of it (fork, interpreter start-up, exit)."""
    busy0, _, own0 = cpu_snapshot()
    t0 = now()
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    wall = now() - t0
    busy1, _, own1 = cpu_snapshot()
    # cores kept busy by everything else on the machine while the command ran
    others = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
    res = {
        "what": what,
        "wall_s": wall,
        "rc": p.returncode,
        "stdout": p.stdout,
        "stderr": p.stderr,
        "others_cores": others,
    }
    if p.returncode not in ok:
        raise RuntimeError(
            f"{what}: exit code {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-3000:]}"
        )
    return res


def run_together_on_one_core(
    runs: list[tuple[list[str], Path, dict[str, str], str]], timeout: float = 1800
) -> list[tuple[dict[str, Any], float]]:
    """Start the commands (cmd, cwd, env, what) at once, all pinned to one
    core, and return each one's result (as `run`'s) and the CPU seconds of
    its process tree. Sharing one core at the same time, they meet the
    same host: on a VM whose speed drifts by 10-40% from minute to minute,
    two identical runs measured this way differ by under 1%, where runs one
    after the other, or at once on two cores, differ by up to 43% and 9%
    (`benches/bench_zoo.py`). Raises, with the output, where one exits nonzero."""
    core = max(os.sched_getaffinity(0))
    outs = []
    for cmd, cwd, env, what in runs:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        p = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True, preexec_fn=lambda: os.sched_setaffinity(0, {core})
        )
        outs.append((p, out, err, what, now()))
    deadline = now() + timeout
    results = []
    for p, out, err, what, t0 in outs:
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if now() > deadline:
                for q, *_ in outs:
                    q.kill()
                raise RuntimeError(f"{what}: still running after {timeout:.0f} s")
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        res = {"what": what, "wall_s": now() - t0, "rc": p.returncode, "stdout": out.read(), "stderr": err.read()}
        if p.returncode != 0:
            raise RuntimeError(
                f"{what}: exit code {p.returncode}\n--- stdout\n{res['stdout'][-3000:]}\n--- stderr\n{res['stderr'][-3000:]}"
            )
        results.append((res, ru.ru_utime + ru.ru_stime))
    return results


def last_json(stdout: str) -> dict[str, Any]:
    """The JSON object a child printed last."""
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    return json.loads(lines[-1])

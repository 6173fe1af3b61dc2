"""A real single-node Slurm cluster for the tests: Debian's slurm-wlm
(slurmctld + slurmd) and munge, started in a private directory on loopback
with their own ports, key and config (nothing under /etc is used or
changed). `make slurm` installs the packages.

    python tests/slurmutil.py -- sbatch --wrap hostname   # a command with the cluster up
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

NODE = "hsnode"
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _config(d: Path, ctld_port: int, slurmd_port: int, cpus: int) -> str:
    return f"""\
ClusterName=hindsight-test
SlurmctldHost={socket.gethostname().split(".")[0]}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.sock
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/slurmd-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# Fast turnaround: a requeued or finished job is rescheduled within a second.
SchedulerParameters=sched_interval=1,bf_interval=1
MinJobAge=600
KillWait=5
InactiveLimit=0
NodeName={NODE} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


@contextlib.contextmanager
def slurm_cluster(d: Path) -> Iterator[dict[str, str]]:
    """munged, slurmctld and slurmd in `d`, as child processes; yields the
    environment (SLURM_CONF) under which sbatch and friends talk to it."""
    missing = missing_programs()
    if missing:
        raise RuntimeError(f"Slurm is not installed ({', '.join(missing)} missing): run `make slurm`")
    d = d.resolve()
    for sub in ("munge", "state", "spool"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(d / "munge", 0o755)  # munged wants its socket reachable by all
    (d / "spool" / f"slurmd-{NODE}").mkdir(exist_ok=True)
    key = d / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    ctld_port, slurmd_port = _free_ports(2)
    conf = d / "slurm.conf"
    conf.write_text(_config(d, ctld_port, slurmd_port, os.cpu_count() or 1))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen[bytes]] = []
    log = open(d / "daemons.out", "wb")
    try:

        def start(*cmd: str) -> None:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))

        start(
            _program("munged"),
            "--foreground",
            "--force",
            f"--socket={d}/munge/munge.sock",
            f"--key-file={key}",
            f"--pid-file={d}/munge/munged.pid",
            f"--log-file={d}/munge/munged.log",
            f"--seed-file={d}/munge/munged.seed",
        )
        _wait(lambda: (d / "munge" / "munge.sock").exists(), 20, "munged", d, procs)
        start(_program("slurmctld"), "-D", "-i", "-f", str(conf))
        start(_program("slurmd"), "-D", "-N", NODE, "-f", str(conf))

        def node_idle() -> bool:
            out = subprocess.run(
                ["sinfo", "-h", "-n", NODE, "-o", "%T"], env=env, capture_output=True, text=True, check=False
            )
            return out.stdout.strip() == "idle"

        _wait(node_idle, 60, "the Slurm node", d, procs)
        yield {"SLURM_CONF": str(conf)}
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True, timeout=10)
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()


def _wait(ready: object, seconds: float, what: str, d: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + seconds
    while not ready():  # type: ignore[operator]
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(
                f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}"
                for f in [*sorted(d.glob("*.log")), d / "daemons.out", d / "munge" / "munged.log"]
                if f.exists()
            )
            raise RuntimeError(f"{what} did not come up within {seconds:.0f}s:\n{logs}")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A running single-node cluster; the SLURM_CONF variable points at it."""
    if sys.platform != "linux":
        pytest.skip("the test cluster runs Debian's slurm-wlm on Linux")
    # Slurm's state and socket paths must be short and world-traversable.
    d = Path(tmp_path_factory.mktemp("slurm"))
    with slurm_cluster(d) as env, pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        yield env


if __name__ == "__main__":
    import tempfile

    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    with tempfile.TemporaryDirectory(prefix="hs-slurm-") as tmp, slurm_cluster(Path(tmp)) as cluster_env:
        sys.exit(subprocess.call(args or ["sinfo"], env={**os.environ, **cluster_env}))

"""Time from a preemption signal to the process exit, durable checkpoint included.

For the example model (examples/preemptible_train.py) and for a ~1 GiB state,
on the local file system, on an S3-protocol server (moto) and on an XRootD
server (tests/xrootdutil.py), both on loopback, directly and local-first
(commit locally, upload in the background; the exit waits for the upload).

The competitor, measured in the same run on the same state: what a
hand-written SIGTERM handler does, `torch.save` + fsync to a file,
`torch.save` to memory + boto3 `upload_fileobj` for S3, or `torch.save` to
memory piped into `xrdcp` for XRootD (the Checkpointer seed's transfer). Its
time is the save alone (no step to finish, no interpreter exit), which
favours it.

    python benches/bench_preempt.py [--gib 1.0] [--trials 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

BIG = """
import sys, time, torch, hindsight as hs
gib = float(sys.argv[1])
n = int(gib * (1 << 30) / 4 / 8)
net = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n)) for _ in range(8)])
opt = torch.optim.SGD(net.parameters(), lr=0.0)
store = sys.argv[2] if len(sys.argv) > 2 else None
with hs.checkpointing(model=net, every=1000):
    for epoch in hs.loop("epoch", range(1000)):
        for step in hs.loop("step", range(1000)):
            with torch.no_grad():
                net[step % 8].add_(1e-3)   # every step changes a tensor: no dedup shortcut
            print("step", flush=True)
            time.sleep(0.01)
"""


BASELINE = """
import io, os, sys, time, torch
gib, dest = float(sys.argv[1]), sys.argv[2]
n = int(gib * (1 << 30) / 4 / 8)
state = {str(i): torch.randn(n) for i in range(8)} if gib > 0 else None
if state is None:  # the example model's state
    from torch import nn
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    net(torch.randn(4, 16)).sum().backward(); opt.step()
    state = {"model": net.state_dict(), "optimizer": opt.state_dict()}
times = []
for k in range(3):
    t0 = time.perf_counter()
    if dest.startswith("s3://"):
        import boto3
        bucket, key = dest[5:].split("/", 1)
        buf = io.BytesIO(); torch.save(state, buf); buf.seek(0)
        boto3.client("s3").upload_fileobj(buf, bucket, f"{key}/ckpt-{k}.pt")
    elif dest.startswith("root://"):
        import subprocess
        buf = io.BytesIO(); torch.save(state, buf)
        subprocess.run(["xrdcp", "-s", "-f", "-", f"{dest}/ckpt-{k}.pt"], input=buf.getbuffer(), check=True)
    else:
        path = os.path.join(dest, f"ckpt-{k}.pt")
        with open(path, "wb") as f:
            torch.save(state, f); f.flush(); os.fsync(f.fileno())
        os.remove(path)
    times.append(time.perf_counter() - t0)
print(min(times), sorted(times)[1])
"""


def start_moto() -> tuple[subprocess.Popen[bytes], dict[str, str]] | None:
    """A moto S3 server on loopback, or None when moto is not installed."""
    try:
        import boto3
        import moto  # noqa: F401
    except ImportError:
        return None
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_REGION": "us-east-1",
    }
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(env["AWS_ENDPOINT_URL"] + "/", timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("moto server did not start") from None
            time.sleep(0.1)
    os.environ.update(env)
    import boto3

    boto3.client("s3").create_bucket(Bucket="bench")
    return proc, env


def measure(cmd: list[str], env: dict[str, str], warm_steps: int) -> tuple[float, float, int]:
    """(signal -> "checkpointed" message, signal -> exit, exit code)."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stderr is not None
    for _ in range(warm_steps):
        if not p.stdout.readline():
            raise RuntimeError(p.stderr.read() if p.stderr else "no output")
    t0 = time.perf_counter()
    p.send_signal(signal.SIGTERM)
    durable = float("nan")
    for line in p.stderr:  # the message comes after the checkpoint is durable (and uploaded)
        if "checkpointed run" in line:
            durable = time.perf_counter() - t0
    p.wait(timeout=600)
    return durable, time.perf_counter() - t0, p.returncode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--dests", help="comma-separated destinations to measure (default: all available)")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} cores, load {load:.1f}, {socket.gethostname()}; python {sys.version.split()[0]}")
    moto = start_moto()
    if moto is None:
        print("moto not installed: no s3 destination")
    sys.path.insert(0, str(REPO / "tests"))
    import contextlib

    import xrootdutil

    servers = contextlib.ExitStack()
    xrootd = None
    if xrootdutil.installed():
        xrootd, xenv = servers.enter_context(xrootdutil.xrootd_server())
        os.environ.update(xenv)
    else:
        print("XRootD not installed (make xrootd): no root destination")
    rows = []
    try:
        with tempfile.TemporaryDirectory(dir=REPO / "bench-out" if (REPO / "bench-out").exists() else None) as tmp:
            big = Path(tmp) / "big.py"
            big.write_text(BIG)
            baseline = Path(tmp) / "baseline.py"
            baseline.write_text(BASELINE)
            cases = [
                (
                    "example model",
                    0.0,
                    [
                        sys.executable,
                        str(REPO / "examples" / "preemptible_train.py"),
                        "--delay",
                        "0.01",
                        "--epochs",
                        "50",
                    ],
                    20,
                ),
                (f"{args.gib:.1f} GiB state", args.gib, [sys.executable, str(big), str(args.gib)], 5),
            ]
            dests = ["local"] + (["s3", "s3 local-first"] if moto else [])
            dests += ["root", "root local-first"] if xrootd else []
            if args.dests:
                dests = [d for d in dests if d in args.dests.split(",")]
            for label, gib, cmd, warm in cases:
                for dest in dests:
                    times, durables = [], []
                    for t in range(args.trials):
                        home = Path(tmp) / f"home-{len(rows)}-{t}"
                        env = {**os.environ, "HINDSIGHT_HOME": str(home), "HINDSIGHT_RESUME": "0"}
                        if dest.startswith("s3"):
                            env["HINDSIGHT_STORE"] = f"s3://bench/{len(rows)}-{t}"
                        elif dest.startswith("root"):
                            env["HINDSIGHT_STORE"] = f"{xrootd}//bench/{len(rows)}-{t}"
                        if dest.endswith("local-first"):
                            env["HINDSIGHT_LOCAL_FIRST"] = str(home / "local")
                        durable, secs, rc = measure(cmd, env, warm)
                        if rc != 85:
                            raise SystemExit(f"{label}, {dest}: exit code {rc}, expected 85")
                        times.append(secs)
                        durables.append(durable)
                        shutil.rmtree(home, ignore_errors=True)
                    target = {
                        "local": tmp,
                        "s3": f"s3://bench/baseline-{len(rows)}",
                        "root": f"{xrootd}//bench/baseline-{len(rows)}",
                    }[dest.split()[0]]
                    out = subprocess.run(
                        [sys.executable, str(baseline), str(gib), target],
                        capture_output=True,
                        text=True,
                        check=True,
                        env=os.environ,
                    ).stdout.split()
                    rows.append((label, dest, statistics.median(durables), statistics.median(times), float(out[1])))
    finally:
        if moto:
            moto[0].kill()
        servers.close()
    print()
    print(
        f"{'state':18} {'destination':15} {'signal->durable s':>18} {'signal->exit s':>15} "
        f"{'baseline save s':>16} {'durable/baseline':>17}"
    )
    for label, dest, durable, exit_s, base in rows:
        comp = {"local": "torch.save+fsync", "s3": "torch.save+boto3", "root": "torch.save+xrdcp"}[dest.split()[0]]
        print(f"{label:18} {dest:15} {durable:18.3f} {exit_s:15.3f} {base:16.3f} {durable / base:17.2f}  ({comp})")
    print("signal->durable: finishing the step, snapshot, hashing, writing, fsync or upload (medians).")
    print("signal->exit adds the interpreter's exit (torch's teardown). Baseline: median of 3 saves alone.")


if __name__ == "__main__":
    main()

"""Time from a preemption signal to the process exit, durable checkpoint included.

For the example model (examples/preemptible_train.py) and for a ~1 GiB state,
on the local file system (and on an S3-protocol server on loopback when
`moto` is installed and the engine was built with object storage).

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


def measure(cmd: list[str], env: dict[str, str], warm_steps: int) -> tuple[float, int]:
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    for _ in range(warm_steps):
        if not p.stdout.readline():
            raise RuntimeError(p.stderr.read() if p.stderr else "no output")
    t0 = time.perf_counter()
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=600)
    return time.perf_counter() - t0, p.returncode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} cores, {socket.gethostname()}; python {sys.version.split()[0]}")
    rows = []
    with tempfile.TemporaryDirectory(dir=REPO / "bench-out" if (REPO / "bench-out").exists() else None) as tmp:
        big = Path(tmp) / "big.py"
        big.write_text(BIG)
        cases = [
            ("example model (14 KiB state)", [sys.executable, str(REPO / "examples" / "preemptible_train.py"),
                                              "--delay", "0.01", "--epochs", "50"], 20),
            (f"{args.gib:.1f} GiB state", [sys.executable, str(big), str(args.gib)], 5),
        ]
        for label, cmd, warm in cases:
            times = []
            for t in range(args.trials):
                home = Path(tmp) / f"home-{len(rows)}-{t}"
                env = {**os.environ, "HINDSIGHT_HOME": str(home), "HINDSIGHT_RESUME": "0"}
                secs, rc = measure(cmd, env, warm)
                if rc != 85:
                    raise SystemExit(f"{label}: exit code {rc}, expected 85")
                times.append(secs)
                shutil.rmtree(home, ignore_errors=True)
            rows.append((label, "local", statistics.median(times), min(times)))
    print(f"{'state':32} {'destination':12} {'median s':>9} {'best s':>9}")
    for label, dest, med, best in rows:
        print(f"{label:32} {dest:12} {med:9.3f} {best:9.3f}")
    print("signal -> exit includes finishing the current step, the checkpoint copy, hashing, writing and fsync.")


if __name__ == "__main__":
    main()

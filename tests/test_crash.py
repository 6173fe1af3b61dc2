"""kill -9 at random moments: every completed checkpoint survives intact and
no half-written checkpoint is ever listed."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import torch

import hindsight as hs

WRITER = r"""
import sys, torch, hindsight as hs
store = hs.Store(sys.argv[1], chunk_size=1 << 20)
trial = int(sys.argv[2])
frozen = torch.randn(1 << 20, generator=torch.Generator().manual_seed(12345))  # shared by all
print("ready", flush=True)
i = 0
while True:
    name = f"t{trial}-c{i}"
    g = torch.Generator().manual_seed(trial * 1000 + i)
    state = {"frozen": frozen, "live": torch.randn(3 << 20, generator=g), "i": i}
    store.save(name, state).wait()
    print("done", name, flush=True)
    i += 1
"""


def expected(trial: int, i: int) -> dict:
    g = torch.Generator().manual_seed(trial * 1000 + i)
    return {"live": torch.randn(3 << 20, generator=g), "i": i}


def test_sigkill_at_random_moments_never_loses_or_tears_a_checkpoint(store_dir):
    rng = random.Random(7)
    deadline = time.monotonic() + 25
    trials = 0
    completed: list[str] = []
    while time.monotonic() < deadline or trials < 5:
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(store_dir), str(trials)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        assert proc.returncode == -signal.SIGKILL
        completed += [line.split()[1] for line in out.splitlines() if line.startswith("done")]
        trials += 1

        store = hs.Store(store_dir)
        listed = set(store.list())
        # Everything reported durable is listed; everything listed loads bit-exactly.
        assert set(completed) <= listed
        for name in listed:
            t, c = name[1:].split("-c")
            got = store.load(name)
            want = expected(int(t), int(c))
            assert got["i"] == want["i"] and torch.equal(got["live"], want["live"]), name
        assert store.verify() == []
        store.close()
    assert trials >= 5 and len(completed) > 0
    # Crashed writers leave staging files; gc removes them and nothing else.
    store = hs.Store(store_dir)
    before = set(store.list())
    store.gc()
    assert not any((store_dir / "tmp").iterdir())
    assert set(store.list()) == before and store.verify() == []

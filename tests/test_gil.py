"""Long calls release the GIL: another Python thread keeps getting it.

Measured as the longest pause of a ticking thread during the call: a call
holding the GIL would pause it for the whole call. (Throughput would measure
CPU contention on a small machine, not the GIL.)"""

from __future__ import annotations

import itertools
import threading
import time

import torch

import hindsight as hs


def longest_pause_during(fn) -> tuple[float, float]:
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    th = threading.Thread(target=tick)
    th.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    time.sleep(0.05)
    stop.set()
    th.join()
    inside = [t for t in ticks if t0 <= t <= t1]
    points = [t0, *inside, t1]
    return max(b - a for a, b in itertools.pairwise(points)), t1 - t0


def test_gil_released_during_save_wait_and_load(store_dir):
    store = hs.Store(store_dir, threads=1)
    state = {f"t{i}": torch.randn(8 << 20) for i in range(8)}  # 256 MiB
    store.save("warm", {"x": torch.ones(1)}).wait()

    pause, duration = longest_pause_during(lambda: store.save("big", state).wait())
    assert duration > 0.1
    assert pause < duration / 2, (pause, duration)

    pause, duration = longest_pause_during(lambda: store.load("big", threads=1))
    assert duration > 0.1
    assert pause < duration / 2, (pause, duration)

    h = store.save("again", {k: v + 1 for k, v in state.items()})
    pause, duration = longest_pause_during(lambda: store.flush())
    assert pause < max(duration / 2, 0.05), (pause, duration)
    h.wait()

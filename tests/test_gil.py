"""Long calls release the GIL: another Python thread keeps running."""

from __future__ import annotations

import threading
import time

import torch

import hindsight as hs


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        while not self.stop.is_set():
            self.n += 1

    def __enter__(self) -> "Counter":
        self.thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def count_during(fn) -> tuple[int, float]:
    with Counter() as c:
        start_n = c.n
        t0 = time.perf_counter()
        fn()
        return c.n - start_n, time.perf_counter() - t0


def test_gil_released_during_save_wait_and_load(store_dir):
    # Baseline: how fast the counter runs while the main thread sleeps (GIL free).
    base, secs = count_during(lambda: time.sleep(0.3))
    rate = base / secs
    store = hs.Store(store_dir, threads=1)
    state = {f"t{i}": torch.randn(8 << 20) for i in range(6)}  # 192 MiB

    def save_and_wait() -> None:
        store.save("big", state).wait()

    n, secs = count_during(save_and_wait)
    assert secs > 0.05
    # Holding the GIL would leave the counter at ~0; demand a good share of free running.
    assert n > 0.2 * rate * secs, (n, rate, secs)

    n, secs = count_during(lambda: store.load("big"))
    assert n > 0.2 * rate * secs, (n, rate, secs)

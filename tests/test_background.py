"""Errors of background writes surface at the next call, at flush, or at exit.

The failure is real: the writer process runs with RLIMIT_FSIZE below the size
of one chunk, so the kernel refuses the chunk write (EFBIG)."""

from __future__ import annotations

from conftest import run_py

PRELUDE = """
import resource, signal, sys, torch, hindsight as hs
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # get EFBIG instead of being killed
store = hs.Store(sys.argv[1])
store.save("small", {"w": torch.ones(10)}).wait()
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
big = {"w": torch.randn(1 << 20)}               # 4 MiB chunk > 64 KiB limit
"""


def test_error_surfaces_at_wait_with_its_class_and_path(store_dir):
    r = run_py(
        PRELUDE
        + """
h = store.save("big", big)
try:
    h.wait()
except hs.StorageError as e:
    print("wait raised", type(e).__name__, e.background, "chunks" in str(e), "'big'" in str(e))
store.flush()   # already reported: flush is clean
print("listed", store.list())
""",
        str(store_dir),
    )
    assert r.returncode == 0, r.stderr
    assert "wait raised StorageError True True True" in r.stdout
    assert "listed ['small']" in r.stdout


def test_error_surfaces_at_next_save_then_saving_works_again(store_dir):
    r = run_py(
        PRELUDE
        + """
h = store.save("big", big)
import time
while not h.done():  # failed in the background; nobody has collected the error
    time.sleep(0.01)
try:
    store.save("next", {"w": torch.ones(3)})
except hs.HindsightError as e:
    print("save raised", type(e).__name__, "big" in str(e))
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
store.save("after", big).wait()
print("listed", store.list())
""",
        str(store_dir),
    )
    assert r.returncode == 0, r.stderr
    assert "save raised StorageError True" in r.stdout
    assert "listed ['after', 'small']" in r.stdout


def test_error_surfaces_at_flush(store_dir):
    r = run_py(
        PRELUDE
        + """
store.save("big", big)
try:
    store.flush()
except hs.StorageError as e:
    print("flush raised", e.background)
""",
        str(store_dir),
    )
    assert r.returncode == 0, r.stderr
    assert "flush raised True" in r.stdout


def test_unreported_error_fails_the_process_at_exit(store_dir):
    r = run_py(
        PRELUDE
        + """
store.save("big", big)
print("exiting normally")
""",
        str(store_dir),
    )
    assert "exiting normally" in r.stdout
    assert r.returncode == 1
    assert "hindsight: error at exit" in r.stderr and "'big'" in r.stderr

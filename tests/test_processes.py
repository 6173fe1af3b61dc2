"""Fork safety, concurrent writers, Ctrl-C, and the installed command."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import hindsight as hs

from conftest import hindsight_cmd, run_py


def test_forked_child_cannot_touch_parent_writer_but_parent_carries_on(store_dir):
    store = hs.Store(store_dir)
    store.save("before", {"w": torch.randn(1 << 20)}).wait()
    h = store.save("in-flight", {"w": torch.randn(4 << 20)})  # writer busy during the fork
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        os.close(r)
        code = 0
        try:
            store.save("from-child", {"x": 1})
            code = 10
        except hs.WrongProcessError:
            pass
        try:
            # Reading is safe in the child: no writer threads involved.
            got = store.load("before")
            os.write(w, str(got["w"].numel()).encode())
        except BaseException:
            code = 11
        os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.read(r, 100) == str(1 << 20).encode()
    os.close(r)
    h.wait()
    store.save("after", {"w": torch.ones(3)}).wait()
    assert store.list() == ["after", "before", "in-flight"]


def test_dataloader_workers_fork_while_saving(store_dir):
    ds = torch.utils.data.TensorDataset(torch.arange(64, dtype=torch.float32))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork")
    store = hs.Store(store_dir)
    total = 0.0
    for epoch in range(2):
        h = store.save(f"e{epoch}", {"w": torch.randn(2 << 20)})
        for (batch,) in loader:
            total += float(batch.sum())
        h.wait()
    assert total == 2 * sum(range(64))
    assert store.list() == ["e0", "e1"]


def test_two_processes_saving_into_one_store(store_dir):
    code = """
import sys, torch, hindsight as hs
store = hs.Store(sys.argv[1])
shared = torch.randn(2 << 20, generator=torch.Generator().manual_seed(0))  # same bytes in both
for i in range(6):
    own = torch.full((1 << 20,), float(i) + (100 if sys.argv[2] == "a" else 200))
    store.save(f"{sys.argv[2]}{i}", {"shared": shared, "own": own})
store.flush()
print("ok")
"""
    hs.Store(store_dir)  # create it first so both open an existing store
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(store_dir), tag], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for tag in "ab"
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "ok", err
    store = hs.Store(store_dir)
    assert len(store.list()) == 12
    assert store.verify() == []
    for tag, base in (("a", 100), ("b", 200)):
        for i in range(6):
            assert float(store.load(f"{tag}{i}", path="own")[0]) == base + i
    # The shared tensor is stored once even though two processes wrote it.
    u = store.usage()
    assert u["unique_bytes"] == (2 << 20) * 4 + 12 * (1 << 20) * 4
    assert u["logical_bytes"] == 12 * ((2 << 20) * 4 + (1 << 20) * 4)


def test_ctrl_c_interrupts_a_blocked_wait(store_dir):
    """A save blocked behind gc's exclusive lock; SIGINT must raise KeyboardInterrupt promptly."""
    hs.Store(store_dir)
    lock = open(store_dir / "gc.lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX)  # play a long-running gc in another process
    try:
        p = subprocess.Popen(
            [
                sys.executable,
                "-c",
                """
import signal, sys, time, torch, hindsight as hs
# What a terminal gives a program: Python's SIGINT handler, SIGINT unblocked.
# A child inherits an ignored SIGINT (a shell without job control starts
# background commands so: `make test &`), and Python then installs no handler.
inherited = (signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]))
signal.signal(signal.SIGINT, signal.default_int_handler)
store = hs.Store(sys.argv[1])
h = store.save("blocked", {"w": torch.ones(10)})
t0 = time.monotonic()
try:  # from before "waiting": a late-scheduled child must not die at top level and block in the exit flush
    print("waiting", inherited, flush=True)
    h.wait()
    print("finished?!")
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - t0:.2f}", flush=True)
import os; os._exit(0)
""",
                str(store_dir),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert p.stdout is not None
        first = p.stdout.readline().strip()
        assert first.startswith("waiting"), first
        time.sleep(0.5)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            # Leave the child's stacks in the log (how an unanswered SIGINT
            # was diagnosed), then press Ctrl-C again, as a user would.
            gdb = shutil.which("gdb")
            stacks = (
                subprocess.run(
                    [gdb, "-p", str(p.pid), "-batch", "-ex", "thread apply all bt"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=False,
                ).stdout
                if gdb
                else "(no gdb)"
            )
            if sys.__stderr__ is not None:
                sys.__stderr__.write(f"\n[first SIGINT unanswered; child stacks]\n{stacks[-20000:]}\n")
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=30)
        assert "interrupted after" in out, (first, out, err)
        assert time.monotonic() - t0 < 80
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
    # The save never committed while gc held the lock: it is not listed.
    assert "blocked" not in hs.Store(store_dir).list()


def test_installed_command_and_exit_codes(store_dir):
    store = hs.Store(store_dir)
    store.save("one", {"w": torch.zeros(100)}).wait()
    store.save("two", {"w": torch.zeros(100)}).wait()
    cmd = hindsight_cmd()
    r = subprocess.run([*cmd, "ls", str(store_dir)], capture_output=True, text=True)
    assert r.returncode == 0 and "one" in r.stdout and "two" in r.stdout
    r = subprocess.run([*cmd, "--store", str(store_dir), "show", "one"], capture_output=True, text=True)
    assert r.returncode == 0 and "w" in r.stdout and "float32" in r.stdout
    r = subprocess.run([*cmd, "du", str(store_dir)], capture_output=True, text=True)
    assert r.returncode == 0 and "dedup ratio" in r.stdout
    r = subprocess.run([*cmd, "--store", str(store_dir), "show", "three"], capture_output=True, text=True)
    assert r.returncode == 1 and "three" in r.stderr
    r = subprocess.run([*cmd, "ls", str(store_dir / "nope")], capture_output=True, text=True)
    assert r.returncode == 1 and "nope" in r.stderr
    r = subprocess.run([*cmd, "--store", str(store_dir), "rm", "one"], capture_output=True, text=True)
    assert r.returncode == 0
    r = subprocess.run([*cmd, "gc", str(store_dir)], capture_output=True, text=True)
    assert r.returncode == 0 and "removed" in r.stdout
    r = subprocess.run([*cmd, "verify", str(store_dir)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert hs.Store(store_dir).list() == ["two"]
    r = run_py("import hindsight.cli as c, sys; sys.exit(c.main(['bogus']))")
    assert r.returncode == 2


_GLOO_EXIT = """
import contextvars, sys, torch, torch.distributed as dist
import hindsight
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
t = torch.ones(1 << 20)
junk = [[i] for i in range(2_000_000)]  # a finalization long enough to be caught in
# What a backward pass does (torch >= 2.11): a Python object in the
# thread-local state that each collective started inside it captures.
torch._C._stash_obj_in_tls("context", contextvars.copy_context())
for _ in range(4):
    dist.all_reduce(t, async_op=True)  # finished, and freed, on gloo's thread
torch._C._remove_obj_from_tls("context")
"""


@pytest.mark.fresh_process
def test_a_process_that_leaves_right_after_a_collective_exits_0_not_aborted_by_gloo(tmp_path):
    """A DDP rank that finished training used to die at exit (-6, "terminate
    called without an active exception") now and then: gloo's thread freed
    the last collective's Python state after the interpreter began to shut
    down. Without hindsight's settling at exit this script aborts in most
    runs; three in a row exit 0."""
    script = tmp_path / "gloo_exit.py"
    script.write_text(_GLOO_EXIT)
    for i in range(3):
        rendezvous = tmp_path / f"rendezvous-{i}"
        r = subprocess.run([sys.executable, str(script), str(rendezvous)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]

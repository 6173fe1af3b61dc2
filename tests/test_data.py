"""The input service (``hs.data``) with real worker processes, real gRPC on
loopback and real signals: every example exactly once per epoch, in the
order (seed, epoch) fixes, with the same random draws, whatever happens to
workers and the dispatcher."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import data_synth
import hindsight as hs
from hindsight.data._codec import decode, encode
from hindsight.errors import (
    DataMismatchError,
    DataPipelineError,
    DataUnreachableError,
    InvalidArgumentError,
    NoDataWorkersError,
)

from conftest import hindsight_cmd

SEED = 5


expected_epoch = data_synth.expected
audit = data_synth.audit


def read(loader: hs.data.Loader, epoch: int, during=None) -> list[torch.Tensor]:
    loader.set_epoch(epoch)
    got = []
    for batch in loader:
        got.append(batch.clone())
        if during is not None:
            during(len(got))
    return got


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_an_epoch_is_each_example_once_in_the_seeded_order_with_the_same_draws_for_any_worker_count():
    runs = {}
    for workers in ("local:1", "local:3"):
        with hs.data.Loader(
            data_synth.make, batch_size=8, seed=SEED, workers=workers, dataset_args={"n": 203}
        ) as loader:
            runs[workers] = [read(loader, e) for e in (0, 1)]
            spec = loader.spec
    for e in (0, 1):
        want = expected_epoch(spec, e)
        for workers, epochs in runs.items():
            assert same(epochs[e], want), f"{workers}, epoch {e}"
            assert audit(epochs[e], want) == (0, 0)
    assert not torch.equal(runs["local:1"][0][0], runs["local:1"][1][0]), "each epoch has its own order"


def test_ranks_get_disjoint_slices_of_the_same_global_batches():
    per_rank = []
    for rank in (0, 1):
        with hs.data.Loader(
            data_synth.make, batch_size=4, seed=SEED, workers="local:1", dataset_args={"n": 64}, rank=rank, world=2
        ) as loader:
            per_rank.append(read(loader, 3))
            spec = loader.spec
    assert spec.global_batch == 8
    single = expected_epoch(spec, 3)
    for b, want in enumerate(single):
        assert torch.equal(torch.cat([per_rank[0][b], per_rank[1][b]]), want)


def resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def test_killed_and_stopped_workers_change_nothing_the_trainer_sees():
    """Worker chaos, bounded: SIGKILL and SIGSTOP/SIGCONT random workers at
    random moments of two epochs; the batches must be exactly those of a run
    without failures."""
    rng = random.Random(11)
    with hs.data.Loader(
        data_synth.make, batch_size=8, seed=SEED, workers="local:3", dataset_args={"n": 480, "sleep_ms": 2}
    ) as loader:
        spec = loader.spec
        read(loader, 0)  # workers are up
        resumes: list[threading.Timer] = []
        for epoch in (1, 2):
            kill_at, stop_at = rng.sample(range(3, len(loader) - 10), 2)

            def chaos(n: int, kill_at: int = kill_at, stop_at: int = stop_at) -> None:
                pids = loader.worker_pids()
                if n == kill_at and pids:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                if n == stop_at and pids:
                    victim = rng.choice(pids)
                    os.kill(victim, signal.SIGSTOP)
                    t = threading.Timer(2.0, resume, (victim,))
                    t.start()
                    resumes.append(t)

            got = read(loader, epoch, chaos)
            want = expected_epoch(spec, epoch)
            assert audit(got, want) == (0, 0)
            assert same(got, want), f"epoch {epoch}: delivered batches differ from a run without failures"
        for t in resumes:
            t.join()
        stats = loader.stats()
    assert stats["failovers"] >= 1, stats
    assert stats["workers_replaced"] >= 1, stats


def test_a_sharded_dataset_is_read_sequentially_each_record_once_in_a_seeded_order(tmp_path):
    """Shards read with open(shard, offset): every record once per epoch,
    the same batches whatever the worker count or a worker kill, and a
    handful of opens (each split reads its shards as contiguous runs)."""
    counts = [37, 0, 50, 23, 60]
    got = {}
    for workers in ("local:1", "local:2"):
        log = tmp_path / f"opens-{workers[-1]}"
        args = {"counts": counts, "open_log": str(log)}
        with hs.data.Loader(data_synth.records, batch_size=8, seed=SEED, workers=workers, dataset_args=args) as loader:
            spec = loader.spec
            pids = []

            def kill_once(n: int, pids: list[int] = pids, workers: str = workers) -> None:
                if workers == "local:2" and n == 6 and not pids:
                    pids.append(loader.worker_pids()[0])
                    os.kill(pids[0], signal.SIGKILL)

            got[workers] = [read(loader, e, kill_once) for e in (0, 1)]
        opens = len(log.read_text().splitlines())
        splits = -(-spec.batches_per_epoch() // spec.split_batches)
        # Sequential: a few opens per split at most (failovers and stall
        # reassignments on a loaded machine add some), never one per record.
        assert opens <= max(2 * (splits + len(counts)) + 4, sum(counts) // 3), f"{opens} opens: not sequential"
    assert list(spec.shards) == counts
    for e in (0, 1):
        want = data_synth.expected_records(spec, e)
        for workers in got:
            assert same(got[workers][e], want), f"{workers}, epoch {e}"
        seen = sorted((int(r[0]), int(r[1])) for b in got["local:2"][e] for r in b)
        assert seen == [(s, o) for s, n in enumerate(counts) for o in range(n)]


def test_workers_taking_over_a_split_restore_its_worker_checkpoint_instead_of_reading_it_again(tmp_path):
    """A sharded dataset whose shards cannot seek and cost time to read:
    workers checkpoint each split's read state (reader positions, records
    read ahead); with every worker killed mid-epoch, the replacements resume
    the readers from those checkpoints, and the epoch is still exact."""
    log = tmp_path / "opens"
    counts = [40, 25, 45, 10]
    args = {"counts": counts, "open_log": str(log), "read_ms": 3, "transform_ms": 8}
    with hs.data.Loader(
        data_synth.stream, batch_size=4, seed=SEED, workers="local:2", split_batches=16, window=2, dataset_args=args
    ) as loader:
        spec = loader.spec
        killed: list[int] = []

        def kill_all(n: int) -> None:
            # Split 0 (batches 0-15) is then mid-way: its worker can be at
            # most 6 units ahead of the trainer (4 buffered, 2 in flight).
            if n == 4:
                killed.extend(loader.worker_pids())
                for pid in killed:
                    os.kill(pid, signal.SIGKILL)

        got = read(loader, 0, kill_all)
        assert len(killed) == 2
    assert same(got, data_synth.expected_records(spec, 0))
    resumed = [line for line in log.read_text().splitlines() if line.startswith("resume")]
    assert resumed, "no worker restored a worker checkpoint after the kill"


def test_a_dataset_that_raises_reaches_the_trainer_with_its_traceback():
    with hs.data.Loader(
        data_synth.make, batch_size=4, workers="local:1", dataset_args={"n": 40, "fail_at": 13}, shuffle=False
    ) as loader:
        with pytest.raises(DataPipelineError) as e:
            read(loader, 0)
    assert "example 13 is broken" in str(e.value)
    assert "Traceback" in str(e.value)
    assert e.value.dataset == "data_synth:make"
    with hs.data.Loader(data_synth.broken, batch_size=4, workers="local:1", length=10) as loader:
        with pytest.raises(DataPipelineError, match="cannot be built here"):
            read(loader, 0)


def test_an_item_that_never_returns_ends_the_epoch_naming_its_index():
    """Issue 22: a `__getitem__` that never returns stalled the loader
    forever (its worker still answers health checks). Past the unit deadline
    the unit goes to another worker; when it hangs every worker, the epoch
    fails naming the example."""
    with hs.data.Loader(
        data_synth.make,
        batch_size=4,
        workers="local:2",
        dataset_args={"n": 40, "hang_at": 13},
        shuffle=False,
        unit_deadline=1.0,
    ) as loader:
        t0 = time.monotonic()
        with pytest.raises(hs.HindsightError) as e:
            read(loader, 0)
    msg = str(e.value)
    assert "unit deadline" in msg and "dataset indices [12, 13, 14, 15]" in msg, msg
    assert "batch 3 of epoch 0" in msg, msg
    assert time.monotonic() - t0 < 60


def test_an_item_that_crashes_every_worker_is_named_with_the_workers_deaths():
    """Issue 22: an item that segfaults its worker surfaced as "h2 protocol
    error". The error now names the unit (batch, dataset indices) and the
    local workers' deaths (the signal)."""
    with hs.data.Loader(
        data_synth.make,
        batch_size=4,
        workers="local:2",
        dataset_args={"n": 40, "crash_at": 13},
        shuffle=False,
    ) as loader:
        with pytest.raises(hs.HindsightError) as e:
            read(loader, 0)
    text = "\n".join([str(e.value), *getattr(e.value, "__notes__", [])])
    if isinstance(e.value, NoDataWorkersError):
        # Replacements died right after starting, before the split gave up.
        assert "last exit code -11" in text, text
    elif "batch 3, dataset indices [12, 13, 14, 15]" not in text:
        # A split streaming on a worker the crash killed fails with it: on 2
        # cores one such split reached its retry limit first once (a CI
        # simulation). It is named with its unit, beside the deaths.
        assert re.search(r"split \d+ of epoch 0 failed \d+ times .* \(the unit: batch \d+, dataset indices", text), text
    assert "killed by SIGSEGV" in text, text


def test_a_factory_workers_cannot_import_is_refused_naming_it():
    with pytest.raises(InvalidArgumentError, match="cannot be imported by a worker"):
        hs.data.Loader(lambda: data_synth.make(10), batch_size=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_dispatcher_fails_fast_naming_the_address(monkeypatch):
    monkeypatch.setenv("HINDSIGHT_DATA_TOKEN", "a-token-for-nobody-0123")
    addr = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(DataUnreachableError) as e:
        hs.data.Loader(data_synth.make, batch_size=2, workers=addr, dataset_args={"n": 10})
    assert time.monotonic() - t0 < 10
    assert e.value.address == addr
    assert addr in str(e.value)


def test_state_dict_continues_at_the_next_batch_and_refuses_another_job():
    args = {"n": 96}
    with hs.data.Loader(data_synth.make, batch_size=8, seed=SEED, workers="local:1", dataset_args=args) as loader:
        spec = loader.spec
        loader.set_epoch(2)
        it = iter(loader)
        first = [next(it).clone() for _ in range(5)]
        state = loader.state_dict()
        assert state["epoch"] == 2 and state["batch"] == 5
        loader.load_state_dict(state)
        rest = [b.clone() for b in loader]
    assert same(first + rest, expected_epoch(spec, 2))
    with hs.data.Loader(data_synth.make, batch_size=16, seed=SEED, workers="local:1", dataset_args=args) as other:
        with pytest.raises(DataMismatchError, match="global_batch: 8 != 16"):
            other.load_state_dict(state)


def start_dispatcher(journal: Path, port: int) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [*hindsight_cmd(), "data", "dispatcher", "--journal", str(journal), "--port", str(port), "--host", "127.0.0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    assert "listening on" in line, (line, p.stderr.read() if p.poll() is not None and p.stderr else "")
    p.first_line = line  # type: ignore[attr-defined]
    return p


def stop(p: subprocess.Popen[str]) -> None:
    p.kill()
    p.wait()
    for pipe in (p.stdout, p.stderr):
        if pipe is not None:
            pipe.close()


def start_worker(port: int, args: str = '{"n": 300, "sleep_ms": 2}') -> subprocess.Popen[str]:
    """A worker given the token as a user gives it: the environment's
    HINDSIGHT_DATA_TOKEN_FILE (see `use_token`)."""
    return subprocess.Popen(
        [*hindsight_cmd(), "data", "worker", "--dispatcher", f"127.0.0.1:{port}", "--dataset", "data_synth:make",
         "--args", args, "--bind", "127.0.0.1:0"],
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])},
        text=True,
    )  # fmt: skip


def use_token(monkeypatch: pytest.MonkeyPatch, journal: Path) -> None:
    """This process and the workers it starts give the dispatcher's token,
    from the file its journal keeps (as its start-up line says)."""
    monkeypatch.setenv("HINDSIGHT_DATA_TOKEN_FILE", str(journal / "token"))


def test_remote_dispatcher_killed_with_a_worker_restarts_from_its_journal_including_a_torn_tail(tmp_path, monkeypatch):
    journal, port = tmp_path / "journal", free_port()
    d = start_dispatcher(journal, port)
    use_token(monkeypatch, journal)
    workers = [start_worker(port) for _ in range(3)]
    try:
        with hs.data.Loader(
            data_synth.make,
            batch_size=8,
            seed=SEED,
            workers=f"127.0.0.1:{port}",
            dataset_args={"n": 300, "sleep_ms": 2},
        ) as loader:
            spec = loader.spec

            def crash(n: int) -> None:
                nonlocal d
                if n != 8:
                    return
                # The dispatcher and a worker die together; the journal is
                # left with a half-written record.
                stop(d)
                stop(workers[0])
                with open(journal / "journal.hsj", "ab") as f:
                    f.write(b"\x40\x00\x00\x00partial")
                d = start_dispatcher(journal, port)
                assert "torn bytes truncated" in d.first_line and " 0 torn" not in d.first_line, d.first_line
                workers.append(start_worker(port))

            got = read(loader, 0, crash)
            want = expected_epoch(spec, 0)
            assert audit(got, want) == (0, 0)
            assert same(got, want)
    finally:
        for p in [d, *workers]:
            stop(p)


def test_a_worker_built_with_other_dataset_arguments_serves_nothing_and_is_named(tmp_path, monkeypatch):
    """Same factory, other arguments: another dataset. Its examples would
    reach the trainer as if they were the job's (issue 22)."""
    port = free_port()
    d = start_dispatcher(tmp_path / "journal", port)
    use_token(monkeypatch, tmp_path / "journal")
    w = start_worker(port, '{"sleep_ms": 2, "n": 480}')
    try:
        with pytest.raises(hs.HindsightError, match=r'dataset arguments mismatch.*\{"n":300,"sleep_ms":2\}.*"n":480'):
            with hs.data.Loader(
                data_synth.make,
                batch_size=8,
                seed=SEED,
                workers=f"127.0.0.1:{port}",
                dataset_args={"n": 300, "sleep_ms": 2},
            ) as loader:
                read(loader, 0)
    finally:
        for p in (d, w):
            stop(p)


def test_a_journal_corrupt_before_its_tail_is_a_named_error(tmp_path, monkeypatch):
    journal, port = tmp_path / "journal", free_port()
    d = start_dispatcher(journal, port)
    use_token(monkeypatch, journal)
    w = start_worker(port)
    try:
        with hs.data.Loader(
            data_synth.make, batch_size=8, workers=f"127.0.0.1:{port}", dataset_args={"n": 300, "sleep_ms": 2}
        ) as loader:
            read(loader, 0)
    finally:
        stop(w)
        stop(d)
    path = journal / "journal.hsj"
    data = bytearray(path.read_bytes())
    data[40] ^= 0xFF  # inside an early record, with intact records after it
    path.write_bytes(bytes(data))
    r = subprocess.run(
        [*hindsight_cmd(), "data", "dispatcher", "--journal", str(journal), "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "corrupt" in r.stderr and "journal.hsj" in r.stderr, r.stderr
    assert path.read_bytes() == bytes(data), "a failed recovery must not change the journal"


def test_units_carry_every_dtype_a_checkpoint_holds():
    """One dtype table for checkpoints and data units (the engine's): a unit
    of float8 or complex32 decoded where a checkpoint of it loads."""
    from hindsight import _native

    names = [n for n in _native.TORCH_DTYPES if hasattr(torch, n)]
    assert {"float8_e4m3fn", "complex32", "uint64", "bfloat16"} <= set(names)
    raw = torch.arange(64, dtype=torch.uint8)
    value = {n: raw[: 64 - 64 % getattr(torch, n).itemsize].view(getattr(torch, n)) for n in names}
    back = decode(bytearray(encode(value)))
    for n, t in value.items():
        assert back[n].dtype == t.dtype, n
        assert torch.equal(back[n].view(torch.uint8), t.view(torch.uint8)), n


@pytest.mark.parametrize(
    "value",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        {"x": torch.randn(2, 3).to(torch.bfloat16), "y": torch.tensor([True, False]), "n": 3, "s": "text"},
        (torch.zeros(0, 5), torch.tensor(2.5, dtype=torch.float64), [np.arange(6, dtype=np.int16).reshape(2, 3), None]),
        {"c": torch.randn(3, dtype=torch.complex64), 7: b"raw", "u8": torch.arange(5, dtype=torch.uint8)},
    ],
)
def test_units_round_trip_every_structure_and_dtype_without_pickle(value):
    back = decode(bytearray(encode(value)))

    def eq(a, b):
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if isinstance(a, np.ndarray):
            return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b, strict=True))
        return a == b

    assert eq(value, back)


TRAIN = Path(__file__).resolve().parent.parent / "examples" / "data_train.py"


def train(home: Path, out: Path, *extra: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(TRAIN), "--epochs", "2", "--delay", "0.01", "--out", str(out), *extra],
        env={**os.environ, "HINDSIGHT_HOME": str(home), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=home.parent,
    )


def finish(p: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=240)
    return p.returncode, out, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    d = tmp_path_factory.mktemp("data-ref")
    code, _, err = finish(train(d / "home", d / "final.pt"))
    assert code == 0, err
    return torch.load(d / "final.pt")


@pytest.mark.parametrize("how", ["SIGTERM", pytest.param("SIGUSR1", marks=pytest.mark.matrix), "kill-9"])
def test_training_fed_by_the_service_resumes_bit_identical_after_preemption(tmp_path, trained, how):
    """40 steps in 2 epochs; interrupt at a random step, run again: the
    weights equal those of the uninterrupted run."""
    rng = random.Random(how)
    home, out = tmp_path / "home", tmp_path / "final.pt"
    env = {"HINDSIGHT_SAFETY_MINUTES": "0.003"} if how == "kill-9" else {}
    p = train(home, out, **env)
    assert p.stdout is not None
    at = rng.randrange(3, 36)
    for _ in range(at):
        assert p.stdout.readline().startswith("step "), p.stderr.read() if p.stderr else ""
    if how == "kill-9":
        p.kill()
        finish(p)
    else:
        p.send_signal(getattr(signal, how))
        code, _, err = finish(p)
        assert code == 85, err
    code, stdout, err = finish(train(home, out, **env))
    assert code == 0, err
    assert "resuming run" in err
    assert stdout.count("step ") <= 40 - at + 1 + (40 if how == "kill-9" else 0)
    weights = torch.load(out)
    assert all(torch.equal(weights[k], trained[k]) for k in trained), f"weights differ ({how} at step {at})"


@pytest.mark.parametrize(
    "header",
    [
        b'{"T": 0, "n": 1000000, "dtype": "float32", "shape": [250000]}',  # past the end
        b'{"T": -64, "n": 4, "dtype": "float32", "shape": [1]}',  # before the buffers
        b'{"T": 0, "n": 4, "dtype": "load", "shape": [1]}',  # not a dtype
        b'{"N": 0, "n": 8, "dtype": "O", "shape": [1]}',  # Python objects
        b'{"T": 0, "n": 4, "dtype": "float32", "shape": [2]}',  # shape vs size
        b'{"B": 0, "n": -3}',
        b"[1, 2]",
        b"not json",
    ],
)
def test_a_malformed_unit_is_a_named_corrupt_error_never_a_wrong_value(header):
    from hindsight.errors import CorruptError

    payload = bytearray(b"HSU1" + len(header).to_bytes(4, "little") + header)
    payload += bytes((-len(payload)) % 64) + bytes(16)
    with pytest.raises(CorruptError, match="data unit"):
        decode(payload)


def test_the_data_commands_name_a_bad_argument_without_a_traceback(tmp_path: Path) -> None:
    """Issue 22: a bad port, heartbeat or journal path, or an unreachable
    dispatcher, ended in a Python traceback (the heartbeat even labelled
    "argument does not match")."""
    journal_file = tmp_path / "journal"
    journal_file.write_text("")
    cases = [
        (["dispatcher", "--journal", str(tmp_path / "j"), "--port", "99999"], 2, "invalid value '99999' for '--port"),
        (["dispatcher", "--journal", str(tmp_path / "j"), "--heartbeat-timeout", "-1"], 1, "heartbeat_timeout"),
        (["dispatcher", "--journal", str(tmp_path / "j"), "--heartbeat-timeout", "1e300"], 1, "a year"),
        (["dispatcher", "--journal", str(journal_file)], 1, str(journal_file)),
        (["worker", "--dispatcher", "127.0.0.1:1", "--dataset", "os:getcwd"], 1, "127.0.0.1:1"),
    ]
    with_token = {**os.environ, "HINDSIGHT_DATA_TOKEN": "some-token-0123456789"}
    without = {k: v for k, v in os.environ.items() if not k.startswith("HINDSIGHT_DATA_TOKEN")}
    for args, code, says, env in [
        *((*case, with_token) for case in cases),
        # A worker not given the token says where it comes from.
        (["worker", "--dispatcher", "127.0.0.1:1", "--dataset", "os:getcwd"], 1, "HINDSIGHT_DATA_TOKEN_FILE", without),
    ]:
        r = subprocess.run([*hindsight_cmd(), "data", *args], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == code, (args, r.stderr)
        assert "Traceback" not in r.stderr and says in r.stderr, (args, r.stderr)
        assert "does not match" not in r.stderr, r.stderr
    # One grammar: the command's help lists the Python-provided commands, and
    # `hindsight data` alone says what it takes (issue 23: "unrecognized").
    r = subprocess.run([*hindsight_cmd(), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "\n  record " in r.stdout and "\n  data " in r.stdout, r.stdout
    r = subprocess.run([*hindsight_cmd(), "data"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Usage: hindsight data [OPTIONS] <COMMAND>" in r.stderr, r.stdout + r.stderr
    assert all(f"\n  {c} " in r.stderr for c in ("dispatcher", "worker", "token")), r.stderr


def test_the_dispatcher_serves_this_machine_unless_told_otherwise_and_then_says_so(tmp_path: Path) -> None:
    """Closed by default (issue 42, item 2): `hindsight data dispatcher`
    listens on loopback; an address other machines reach is asked for, and
    named as such with the warning that calls travel unencrypted."""
    for host, exposed in ((None, False), ("0.0.0.0", True)):
        port = free_port()
        cmd = [*hindsight_cmd(), "data", "dispatcher", "--journal", str(tmp_path / f"j{port}"), "--port", str(port)]
        p = subprocess.Popen(
            cmd + (["--host", host] if host else []), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert p.stdout is not None and p.stderr is not None
        line = p.stdout.readline()
        p.kill()
        _, err = p.communicate(timeout=30)
        assert f"listening on {'0.0.0.0' if exposed else '127.0.0.1'}:{port}" in line, (line, err)
        assert ("travel unencrypted" in err) == exposed, err
        assert f"HINDSIGHT_DATA_TOKEN_FILE={tmp_path / f'j{port}' / 'token'}" in err, err


def test_without_the_token_a_caller_gets_nothing_from_the_service_and_a_trainer_is_told_why(tmp_path, monkeypatch):
    """Every call is authenticated (issue 42, item 2): with the real
    dispatcher and worker processes, a trainer without the token, or with
    another, is refused in one error that names where the token comes from
    and nothing of the service; the token holder reads the epoch."""
    journal, port = tmp_path / "journal", free_port()
    d = start_dispatcher(journal, port)
    token = (journal / "token").read_text().strip()
    assert (journal / "token").stat().st_mode & 0o077 == 0, "the token file is the owner's alone"
    use_token(monkeypatch, journal)
    w = start_worker(port)
    try:
        monkeypatch.delenv("HINDSIGHT_DATA_TOKEN_FILE")
        for given in (None, "not-the-token-0123456789"):
            if given is not None:
                monkeypatch.setenv("HINDSIGHT_DATA_TOKEN", given)
            with pytest.raises(hs.HindsightError) as e:
                hs.data.Loader(
                    data_synth.make, batch_size=8, workers=f"127.0.0.1:{port}", dataset_args={"n": 300, "sleep_ms": 2}
                )
            msg = str(e.value)
            assert "HINDSIGHT_DATA_TOKEN" in msg and token not in msg, msg
            assert "data_synth" not in msg and "worker" not in msg.split("token")[0], msg
        monkeypatch.setenv("HINDSIGHT_DATA_TOKEN", token)
        with hs.data.Loader(
            data_synth.make,
            batch_size=8,
            seed=SEED,
            workers=f"127.0.0.1:{port}",
            dataset_args={"n": 300, "sleep_ms": 2},
        ) as loader:
            assert same(read(loader, 0), expected_epoch(loader.spec, 0))
    finally:
        for p in (d, w):
            stop(p)


def test_a_job_token_from_hindsight_data_token_reads_its_datasets_job_and_no_other(tmp_path, monkeypatch):
    """Several jobs on one service (issue 42, item 2): the operator derives a
    job token per dataset with `hindsight data token`; a trainer holding
    one reads its dataset's epoch exactly, a token made for another dataset
    is refused naming nothing of the service, and neither is the service's
    token itself."""
    journal, port = tmp_path / "journal", free_port()
    d = start_dispatcher(journal, port)
    use_token(monkeypatch, journal)
    w = start_worker(port)
    try:
        monkeypatch.delenv("HINDSIGHT_DATA_TOKEN_FILE")

        def job_token(dataset: str) -> str:
            r = subprocess.run(
                [*hindsight_cmd(), "data", "token", "--dataset", dataset, "--journal", str(journal)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert r.returncode == 0, r.stderr
            return r.stdout.strip()

        mine, theirs = job_token("data_synth:make"), job_token("data_synth:records")
        service = (journal / "token").read_text().strip()
        assert mine != theirs and service not in mine + theirs
        monkeypatch.setenv("HINDSIGHT_DATA_TOKEN", theirs)
        with pytest.raises(hs.HindsightError) as e:
            hs.data.Loader(
                data_synth.make, batch_size=8, workers=f"127.0.0.1:{port}", dataset_args={"n": 300, "sleep_ms": 2}
            )
        assert "not good for that call" in str(e.value) and "data_synth" not in str(e.value), e.value
        monkeypatch.setenv("HINDSIGHT_DATA_TOKEN", mine)
        with hs.data.Loader(
            data_synth.make,
            batch_size=8,
            seed=SEED,
            workers=f"127.0.0.1:{port}",
            dataset_args={"n": 300, "sleep_ms": 2},
        ) as loader:
            assert same(read(loader, 0), expected_epoch(loader.spec, 0))
        # Without a journal or a token to derive from, the command says where to get one.
        env = {k: v for k, v in os.environ.items() if not k.startswith("HINDSIGHT_DATA_TOKEN")}
        r = subprocess.run(
            [*hindsight_cmd(), "data", "token", "--dataset", "x:y"], capture_output=True, text=True, env=env, timeout=60
        )
        assert r.returncode == 1 and "HINDSIGHT_DATA_TOKEN_FILE" in r.stderr, r.stderr
    finally:
        for p in (d, w):
            stop(p)


def _certificates(d: Path) -> tuple[Path, Path, Path]:
    """A test authority and a certificate it signed for 127.0.0.1 (PEM), made
    with `cryptography` (installed with moto[server], which the S3 tests use)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key, issuer: str, signer, ca: bool, san: x509.SubjectAlternativeName | None):
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san is not None:
            b = b.add_extension(san, critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("test authority", ca_key, "test authority", ca_key, True, None)
    key = ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    leaf = cert("127.0.0.1", key, "test authority", ca_key, False, san)
    paths = (d / "ca.pem", d / "cert.pem", d / "key.pem")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def test_with_certificates_in_the_environment_the_service_runs_over_tls_with_the_same_epoch(tmp_path, monkeypatch):
    """Issue 42: TLS where the user gives certificates. The loader's
    dispatcher, its worker processes and the trainer all take them from
    the environment; the epoch is the one plain text delivers; a half-given
    setting is refused, naming the missing variable."""
    ca, cert, key = _certificates(tmp_path)
    monkeypatch.setenv("HINDSIGHT_DATA_TLS_CA", str(ca))
    monkeypatch.setenv("HINDSIGHT_DATA_TLS_CERT", str(cert))
    monkeypatch.setenv("HINDSIGHT_DATA_TLS_KEY", str(key))
    with hs.data.Loader(data_synth.make, batch_size=8, seed=SEED, workers="local:2", dataset_args={"n": 64}) as loader:
        got = read(loader, 0)
        spec = loader.spec
    want = expected_epoch(spec, 0)
    assert same(got, want)
    # Verified, not merely encrypted: trusting another authority, nothing connects.
    (tmp_path / "other").mkdir()
    other_ca, _, _ = _certificates(tmp_path / "other")
    monkeypatch.setenv("HINDSIGHT_DATA_TLS_CA", str(other_ca))
    with pytest.raises(hs.errors.DataUnreachableError, match="HINDSIGHT_DATA_TLS_CA"):
        with hs.data.Loader(
            data_synth.make, batch_size=8, seed=SEED, workers="local:1", dataset_args={"n": 64}
        ) as loader:
            read(loader, 0)
    monkeypatch.setenv("HINDSIGHT_DATA_TLS_CA", str(ca))
    monkeypatch.delenv("HINDSIGHT_DATA_TLS_KEY")
    with pytest.raises(hs.InvalidArgumentError, match="HINDSIGHT_DATA_TLS_CERT is set but HINDSIGHT_DATA_TLS_KEY"):
        with hs.data.Loader(
            data_synth.make, batch_size=8, seed=SEED, workers="local:1", dataset_args={"n": 64}
        ) as loader:
            read(loader, 0)

"""A DataLoader iterator kept across iterations (minGPT's Trainer.run:
``data_iter = iter(train_loader)`` before the loop, ``next(data_iter)`` in
it, a new iterator on StopIteration). A resume re-creates it where the
interrupted run left it, whatever the sampler, the workers or the loader's
own generator, or stops naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import hindsight_cmd

pytestmark = pytest.mark.timeout(300)

SCRIPT = """
import itertools, os, random, signal, time
import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler, TensorDataset
import hindsight as hs

torch.manual_seed(0)
mode, workers = os.environ["MODE"], int(os.environ["WORKERS"])
data = TensorDataset(torch.arange(40, dtype=torch.float32).unsqueeze(1))


class PidOrder(Sampler):  # an order hindsight cannot re-create: drawn per process
    def __init__(self):
        self.rng = random.Random(os.getpid())
    def __len__(self):
        return 40
    def __iter__(self):
        return iter(self.rng.sample(range(40), 40))


if mode == "replacement":  # minGPT's sampler
    loader = DataLoader(data, sampler=RandomSampler(data, replacement=True, num_samples=10**9), batch_size=4,
                        num_workers=workers)
elif mode == "generator":
    g = torch.Generator()
    g.manual_seed(7)
    loader = DataLoader(data, shuffle=True, batch_size=4, num_workers=workers, generator=g)
elif mode == "pid":
    loader = DataLoader(data, sampler=PidOrder(), batch_size=4, num_workers=workers)
else:
    loader = DataLoader(data, shuffle=True, batch_size=4, num_workers=workers)
model = torch.nn.Linear(1, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
kill_at, flag = int(os.environ.get("KILL_AT", "-1")), os.environ.get("FLAG", "")
data_iter = iter(loader)
with hs.checkpointing(model=model, optimizer=opt):
    for it in hs.loop("iter", itertools.count()):
        try:
            (x,) = next(data_iter)
        except StopIteration:
            data_iter = iter(loader)
            (x,) = next(data_iter)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        hs.log("x", x.flatten().tolist())
        hs.log("noise", torch.rand(1).item())
        if it == kill_at and flag and not os.path.exists(flag):
            open(flag, "w").close()
            # The kill lands where the previous iteration's checkpoint (saved
            # in the background) is durable, so the resume re-creates the
            # iterator there, however busy the machine.
            store, deadline = hs.Store(os.path.join(os.environ["HINDSIGHT_HOME"], "store")), time.monotonic() + 60
            while it > 0 and time.monotonic() < deadline:
                if any(c.index >= it - 1 for c in store.checkpoints(hs.run_id())):
                    break
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        if it >= 29:
            break
print("final", repr(model.weight.item()), repr(model.bias.item()))
"""


def launch(tmp: Path, home: str, mode: str, workers: int, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HINDSIGHT_HOME": str(tmp / home),
        "HINDSIGHT_CHECKPOINT_EVERY": "1",
        "MODE": mode,
        "WORKERS": str(workers),
        **extra,
    }
    script = tmp / "train.py"
    if not script.exists():
        script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240, cwd=tmp)


def logged(tmp: Path, home: str) -> list[tuple[object, object, object]]:
    code = "import hindsight as hs\nprint(hs.dataframe('x', 'noise').to_json(orient='records'))\n"
    env = {**os.environ, "HINDSIGHT_HOME": str(tmp / home)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=tmp)
    assert r.returncode == 0, r.stderr
    return sorted((row["iter"], row["x"], row["noise"]) for row in json.loads(r.stdout))


def final(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, r.stderr[-3000:]
    return next(line for line in r.stdout.splitlines() if line.startswith("final"))


# Steps at the boundaries: the first, the last of the first pass over the
# data (10 batches), the first of the re-created iterator, the last of the
# run; and one inside.
CASES = [
    ("replacement", 0, (0, 17, 29)),
    ("shuffle", 0, (9, 10)),
    ("shuffle", 2, (10, 23)),
    ("generator", 0, (13,)),
]


@pytest.mark.parametrize(("mode", "workers", "steps"), CASES, ids=[f"{m}-w{w}" for m, w, _ in CASES])
def test_a_kill_at_any_step_resumes_the_kept_iterator_exactly(tmp_path: Path, mode: str, workers: int, steps) -> None:
    ref = launch(tmp_path, "ref", mode, workers)
    want, want_logs = final(ref), logged(tmp_path, "ref")
    assert len(want_logs) == 30
    for at in steps:
        home, flag = f"k{at}", str(tmp_path / f"flag{at}")
        first = launch(tmp_path, home, mode, workers, KILL_AT=str(at), FLAG=flag)
        assert first.returncode == -9, f"step {at}: {first.stderr[-2000:]}"
        again = launch(tmp_path, home, mode, workers)
        assert "continues from checkpoint" in again.stderr or at == 0, again.stderr[-2000:]
        assert final(again) == want, f"killed at step {at}"
        assert logged(tmp_path, home) == want_logs, f"killed at step {at}"


def test_an_order_that_cannot_be_recreated_stops_the_resume_naming_the_iterator(tmp_path: Path) -> None:
    """The sampler draws its order from a generator seeded per process: the
    re-created iterator draws other indices, and the resume says so instead
    of training on other batches (this is what the draw check is for)."""
    first = launch(tmp_path, "h", "pid", 0, KILL_AT="15", FLAG=str(tmp_path / "flag"))
    assert first.returncode == -9, first.stderr[-2000:]
    again = launch(tmp_path, "h", "pid", 0)
    assert again.returncode != 0
    assert "DivergenceError: resume: the DataLoader iterator 'data_iter'" in again.stderr, again.stderr[-3000:]
    assert "does not draw the recorded indices" in again.stderr


STORED_INTO = """
import threading, torch, hindsight as hs

class Trainer:  # state on self, next to something no checkpoint holds
    def __init__(self):
        self.iter_num, self.lock = 0, threading.Lock()

    def run(self):
        net = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with hs.checkpointing(model=net, optimizer=opt{extra}):
            for _ in hs.loop("iter", range(3)):
                opt.zero_grad()
                net(torch.ones(1, 2)).sum().backward()
                opt.step()
                self.iter_num += 1
        print("iters", self.iter_num)

Trainer().run()
"""


@pytest.mark.parametrize("extra", ["", ', transient=["self"]'])
def test_an_object_the_loop_stores_into_must_be_kept_or_declared_transient(tmp_path: Path, extra: str) -> None:
    """`self.iter_num += 1` changes `self` for certain (not maybe, as a method
    call does): if the checkpoint cannot keep it, a resume would restart the
    counter, so recording stops naming it, unless it is declared transient."""
    script = tmp_path / "t.py"
    script.write_text(STORED_INTO.format(extra=extra))
    env = {**os.environ, "HINDSIGHT_HOME": str(tmp_path / "home"), "HINDSIGHT_CHECKPOINT_EVERY": "100"}
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    if extra:
        assert r.returncode == 0, r.stderr[-2000:]
        assert "iters 3" in r.stdout
    else:
        assert r.returncode == 1
        assert "variable 'self' (line 16) is stored into by loop 'iter'" in r.stderr, r.stderr[-2000:]
        assert "lock cannot be checkpointed" in r.stderr


SEEDED = """
import os, signal, time
import torch
from torch.utils.data import DataLoader, TensorDataset
import hindsight as hs

torch.manual_seed(0)
g = torch.Generator()
g.manual_seed(7)  # PyTorch's recipe for a reproducible loading order
data = TensorDataset(torch.arange(16, dtype=torch.float32).unsqueeze(1))
loader = DataLoader(data, shuffle=True, batch_size=4, generator=g, num_workers=int(os.environ["WORKERS"]))
model = torch.nn.Linear(1, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
stop, flag = os.environ.get("STOP", ""), os.environ.get("FLAG", "")
with hs.checkpointing(model=model, optimizer=opt):
    for epoch in hs.loop("epoch", range(4)):
        for step, (x,) in enumerate(hs.loop("step", loader)):
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            hs.log("x", x.flatten().tolist())
            if stop.startswith(f"{epoch}:{step}:") and flag and not os.path.exists(flag):
                open(flag, "w").close()
                # A kill lands once the previous epoch's checkpoint (saved in the background) is durable.
                store, deadline = hs.Store(os.path.join(os.environ["HINDSIGHT_HOME"], "store")), time.monotonic() + 60
                while epoch > 0 and time.monotonic() < deadline:
                    if any(c.index >= epoch - 1 and c.kind == "block" for c in store.checkpoints(hs.run_id())):
                        break
                    time.sleep(0.01)
                os.kill(os.getpid(), getattr(signal, stop.split(":")[2]))
        # probe
print("final", repr(model.weight.item()), repr(model.bias.item()))
"""


def seeded_run(tmp: Path, home: str, workers: int, probe: bool = False, **extra: str):
    script = tmp / ("probed.py" if probe else "seeded.py")
    if not script.exists():
        src = SEEDED if not probe else SEEDED.replace("# probe", 'hs.log("w", model.weight.item())')
        script.write_text(src)
    env = {
        **os.environ,
        "HINDSIGHT_HOME": str(tmp / home),
        "HINDSIGHT_CHECKPOINT_EVERY": "1",
        "WORKERS": str(workers),
        **extra,
    }
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240, cwd=tmp)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_with_its_own_seeded_generator_resumes_and_replays_in_the_recorded_order(
    tmp_path: Path, workers: int
) -> None:
    """`DataLoader(shuffle=True, generator=g)`: each epoch's order comes from
    g, which the program seeds once. A resumed process seeds it afresh, so
    without g's state in the checkpoint the epochs after the resume repeat
    another order: exit 0 and other weights (seen before this test). Killed
    at an epoch's first step (resumed from the epoch boundary) and stopped by
    SIGTERM inside an epoch, the runs end as the uninterrupted one; a replay
    of an epoch probe gives the probed run's values."""
    want = final(seeded_run(tmp_path, "ref", workers))
    for stop in ("2:0:SIGKILL", "1:2:SIGTERM"):
        home = stop.replace(":", "-")
        first = seeded_run(tmp_path, home, workers, STOP=stop, FLAG=str(tmp_path / f"{home}.flag"))
        assert first.returncode in (-9, 85), first.stderr[-2000:]
        again = seeded_run(tmp_path, home, workers)
        assert "continues from checkpoint" in again.stderr, again.stderr[-2000:]
        assert final(again) == want, stop

    probed = seeded_run(tmp_path, "probed", workers, probe=True)
    assert final(probed) == want
    (tmp_path / "seeded.py").write_text((tmp_path / "probed.py").read_text())
    r = subprocess.run(
        [*hindsight_cmd(), "replay", str(tmp_path / "seeded.py"), "-q", "-j", "2"],
        env={**os.environ, "HINDSIGHT_HOME": str(tmp_path / "ref"), "WORKERS": str(workers)},
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    code = "import hindsight as hs\nprint(hs.dataframe('w').to_json(orient='records'))\n"
    got = {}
    for home in ("ref", "probed"):
        q = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "HINDSIGHT_HOME": str(tmp_path / home)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert q.returncode == 0, q.stderr
        got[home] = sorted((row["epoch"], row["w"]) for row in json.loads(q.stdout) if row.get("w") is not None)
    assert len(got["probed"]) == 4
    assert got["ref"] == got["probed"]


CONFIG = """
import os, time, torch, hindsight as hs
net = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
cfg = {"lr": 0.1}
with hs.checkpointing(model=net, optimizer=opt):
    for epoch in hs.loop("epoch", range(3)):
        torch.backends.cudnn.benchmark = True  # process-wide configuration: not state
        os.environ["EPOCH"] = str(epoch)
        cfg["lr"] *= 0.5  # state, changed by a store into the dict
        opt.zero_grad()
        net(torch.ones(1, 2)).sum().backward()
        opt.step()
        time.sleep(0.3)  # the epoch's checkpoint is durable before the kill
        if epoch == 1 and os.environ.get("FLAG") and not os.path.exists(os.environ["FLAG"]):
            open(os.environ["FLAG"], "w").close()
            os.kill(os.getpid(), 9)
print("lr", cfg["lr"])
"""


def test_a_dict_stored_into_resumes_and_module_settings_are_not_refused(tmp_path: Path) -> None:
    """`cfg["lr"] *= 0.5` changes `cfg` (a resume used to restart it from
    the code before the loop); `torch.backends.cudnn.benchmark = True` and
    `os.environ[k] = v` store into modules, configuration the code sets
    again, and are not refused."""
    script = tmp_path / "t.py"
    script.write_text(CONFIG)
    env = {**os.environ, "HINDSIGHT_HOME": str(tmp_path / "home"), "HINDSIGHT_CHECKPOINT_EVERY": "1"}
    first = subprocess.run(
        [sys.executable, str(script)],
        env={**env, "FLAG": str(tmp_path / "flag")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert first.returncode == -9, first.stderr[-2000:]
    again = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "continues from checkpoint" in again.stderr
    assert again.stdout.strip() == "lr 0.0125"

"""Loop state kept in plain Python variables (nanoGPT-shaped training):
an iteration counter driving the warm-up, gradient accumulation, the next
batch prefetched inside the step, the last `loss` read after the step
loop. Resume and replay must see them as the uninterrupted run did."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from hindsight.errors import UnsupportedTypeError

from conftest import REPO, hindsight_cmd

SCRIPT = REPO / "examples" / "iteration_train.py"
ARGS = ["--rounds", "5", "--eval_interval", "6"]
PROBES = (
    '        hs.log("val_loss", val_loss)\n',
    '        hs.log("val_loss", val_loss)\n'
    '        hs.log("last_loss", loss.item())\n'
    '        hs.log("iter_at", iter_num)\n'
    '        hs.log("x_sum", int(X.sum()))\n',
)


def values(home: Path, *names: str) -> dict[int, dict[str, object]]:
    """{round: {name: value}} of the latest run, via hs.dataframe in a fresh process."""
    code = (
        "import sys, hindsight as hs\n"
        "df = hs.dataframe(*sys.argv[1:])\n"
        "print(df.drop(columns=['run']).to_json(orient='records'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code, *names], env=env(home), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out: dict[int, dict[str, object]] = {}
    for row in json.loads(r.stdout):
        if row.get("round") is not None and row.get("step") is None:
            out.setdefault(row["round"], {}).update({n: row[n] for n in names if row.get(n) is not None})
    return out


def project(root: Path, *edits: tuple[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    src = SCRIPT.read_text()
    for old, new in edits:
        assert old in src
        src = src.replace(old, new, 1)
    (root / "train.py").write_text(src)
    return root / "train.py"


def env(home: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "HINDSIGHT_HOME": str(home), "HINDSIGHT_CHECKPOINT_EVERY": "1", **extra}


def run(script: Path, home: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *ARGS, *extra],
        env=env(home),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=script.parent,
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The uninterrupted run, with the probes from the start."""
    root = tmp_path_factory.mktemp("ref")
    script = project(root, PROBES)
    r = run(script, root / ".hindsight", "--out", str(root / "final.pt"))
    assert r.returncode == 0, r.stderr
    return root / ".hindsight", torch.load(root / "final.pt")


# Asserts the plan: beside another test's load the cost rule may rightly execute an epoch instead.
@pytest.mark.serial
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_probe_after_the_step_loop_reads_the_variables_the_skipped_steps_left(tmp_path, reference, workers):
    ref_home, _ = reference
    script = project(tmp_path / "proj")
    home = tmp_path / "proj" / ".hindsight"
    r = run(script, home)
    assert r.returncode == 0, r.stderr
    project(tmp_path / "proj", PROBES)
    r = subprocess.run(
        [*hindsight_cmd(), "replay", str(script), "-q", "-j", workers],
        env=env(home),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=script.parent,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 inner-loop steps executed" in r.stdout, r.stdout
    names = ("last_loss", "iter_at", "x_sum")
    got, want = values(home, *names), values(ref_home, *names)
    assert [want[r]["iter_at"] for r in sorted(want)] == [6, 12, 18, 24, 30]
    assert got == want


# SIGTERM takes SIGUSR1's path (CI: test_preempt's SIGTERM case).
@pytest.mark.parametrize(
    "sig", [signal.SIGUSR1, pytest.param(signal.SIGTERM, marks=pytest.mark.matrix)], ids=["SIGUSR1", "SIGTERM"]
)
def test_a_signal_mid_run_resumes_the_counter_the_prefetched_batch_and_the_weights(tmp_path, reference, sig):
    _, want = reference
    script = project(tmp_path / "proj", PROBES)
    home, out = tmp_path / "proj" / ".hindsight", tmp_path / "final.pt"
    at = random.Random(sig).randrange(3, 27)
    p = subprocess.Popen(
        [sys.executable, str(script), *ARGS, "--delay", "0.02", "--out", str(out)],
        env=env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=script.parent,
    )
    assert p.stdout is not None
    seen = 0
    while seen < at:
        line = p.stdout.readline()
        assert line, p.stderr.read() if p.stderr else ""
        seen += line.startswith("iter ")
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 85, err
    r = run(script, home, "--delay", "0.02", "--out", str(out))
    assert r.returncode == 0, r.stderr
    got = torch.load(out)
    assert got["iter_num"] == want["iter_num"] == 30
    assert got["best_val"] == want["best_val"]
    for k, t in want["model"].items():
        assert torch.equal(got["model"][k], t), k


def _watch(box: list, iterable):  # type: ignore[no-untyped-def]
    """A stand-in for hs.loop: finds the variables the caller's loop changes."""
    from hindsight._run.loopvars import LoopVars

    box.append(LoopVars.of(sys._getframe(1), "step", set()))
    yield from iterable


def _restore_into_caller(saved: dict):  # type: ignore[no-untyped-def]
    from hindsight._run.loopvars import LoopVars

    lv = LoopVars.of(sys._getframe(1), "step", set())
    assert lv is not None
    lv.restore(saved)
    yield from ()


def test_loop_variables_of_a_function_frame_are_captured_and_written_back():
    def train(box: list) -> tuple[int, torch.Tensor | None]:
        total, last, handle = 0, None, None
        for i in _watch(box, range(4)):
            total += i
            last = torch.full((2,), float(i))
            handle = threading.Lock()  # changed, read later, not storable
        assert handle is not None and not handle.locked()
        return total, last

    box: list = []
    assert train(box)[0] == 6
    lv = box[0]
    # An unstorable variable read later is refused, naming it, its line and the fix ...
    with pytest.raises(UnsupportedTypeError, match=r"variable 'handle' \(line \d+\).*transient=\[\"handle\"\]"):
        lv.capture(lv.names)
    # ... unless declared transient.
    saved = lv.capture(lv.names, transient={"handle"})
    assert saved["values"]["total"] == 6 and torch.equal(saved["values"]["last"], torch.full((2,), 3.0))
    assert "handle" not in saved["values"]

    def resumed() -> tuple[int, torch.Tensor | None]:
        total, last = -1, None
        for _ in _restore_into_caller(saved):
            pass
        return total, last

    total, last = resumed()
    assert total == 6 and last is not None and torch.equal(last, torch.full((2,), 3.0))


UNSTORABLE = """
import io, torch, hindsight as hs
net = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
with hs.checkpointing(model=net, optimizer=opt{extra}):
    for epoch in hs.loop("epoch", range(3)):
        for step in hs.loop("step", range(4)):
            opt.zero_grad()
            net(torch.ones(1, 2)).sum().backward()
            opt.step()
        report = io.StringIO()
        report.write(str(epoch))
print("last report", report.getvalue())
"""


@pytest.mark.parametrize("extra", ["", ', transient=["report"]'])
def test_a_loop_variable_that_cannot_be_checkpointed_is_refused_at_record_unless_transient(
    tmp_path: Path, extra: str
) -> None:
    """A variable the loop assigns and later code reads that the store cannot
    hold would make a resume go on with another value: recording stops at the
    first block's end, naming it, its line and the fix; declared transient, it
    records."""
    script = tmp_path / "t.py"
    script.write_text(UNSTORABLE.format(extra=extra))
    r = subprocess.run(
        [sys.executable, str(script)],
        # A period longer than the run: the refusal does not wait for a checkpoint.
        env={**os.environ, "HINDSIGHT_HOME": str(tmp_path / "home"), "HINDSIGHT_CHECKPOINT_EVERY": "100"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if extra:
        assert r.returncode == 0, r.stderr[-2000:]
        assert "last report 2" in r.stdout
    else:
        assert r.returncode == 1
        assert "UnsupportedTypeError: variable 'report' (line 11) is assigned by loop 'epoch'" in r.stderr
        assert "_io.StringIO cannot be checkpointed" in r.stderr and 'transient=["report"]' in r.stderr


UNKEPT = """
import threading, torch, hindsight as hs

class Bar:  # a progress bar's shape: a counter, and a lock no checkpoint holds
    def __init__(self):
        self.n, self.lock = 0, threading.Lock()
    def update(self):
        with self.lock:
            self.n += 1

net = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
bar = Bar()
with hs.checkpointing(model=net, optimizer=opt):
    for epoch in hs.loop("epoch", range(2)):
        for step in hs.loop("step", range(3)):
            opt.zero_grad()
            net(torch.ones(1, 2)).sum().backward()
            opt.step()
            bar.update()
print("bar", bar.n)
"""


def test_an_object_the_loop_changes_through_methods_that_no_checkpoint_keeps_is_named(tmp_path: Path) -> None:
    """Not refused (progress bars and summary writers are such objects), but
    no longer left out silently: the run's closing note names it and why."""
    script = tmp_path / "t.py"
    script.write_text(UNKEPT)
    r = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "HINDSIGHT_HOME": str(tmp_path / "home"), "HINDSIGHT_CHECKPOINT_EVERY": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "bar 6" in r.stdout
    assert "note: not in this run's checkpoints: 'bar' (Bar: " in r.stderr, r.stderr
    note = r.stderr.split("not in this run's checkpoints", 1)[1].split("\n", 1)[0]
    assert "lock" in note, r.stderr
    # Modules and functions called through (torch.ones, hs.loop) are not state.
    assert "'torch'" not in note and "'hs'" not in note, note


def test_a_variable_aliasing_a_checkpointed_object_is_not_restored_as_a_copy():
    from hindsight._run.loopvars import _storages

    net = torch.nn.Linear(2, 2)

    def train(box: list) -> None:
        w, step = None, 0
        for _ in _watch(box, range(2)):
            w = net.weight.data  # an alias of the model's parameter
            step += 1
        assert w is not None and step == 2

    box: list = []
    train(box)
    saved = box[0].capture(box[0].names, _storages({"model": net.state_dict()}))
    assert "w" not in saved["values"] and saved["values"]["step"] == 2


ACCUMULATE = """\
import os, signal, sys
import torch
import hindsight as hs

ACC = 4
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
with hs.checkpointing(model=net, optimizer=opt):
    for epoch in hs.loop("epoch", range(3)):
        for step in hs.loop("step", range(8)):
            g = torch.Generator().manual_seed(epoch * 100 + step)
            x = torch.randn(16, 8, generator=g)
            loss = (net(x) - x[:, :1]).pow(2).mean() / ACC
            loss.backward()
            if (step + 1) % ACC == 0:
                opt.step()
                opt.zero_grad()
            if os.environ.get("SIGNAL_AT") == f"{epoch}.{step}" and not os.path.exists(os.environ["MARK"]):
                open(os.environ["MARK"], "w").close()
                os.kill(os.getpid(), signal.SIGUSR1)
torch.save({k: v.clone() for k, v in net.state_dict().items()}, sys.argv[1])
"""


def interrupted_and_reference(tmp_path: Path, text: str, at: str, suffix: str) -> tuple[Path, Path]:
    """Run `text` (which sends itself SIGUSR1 at SIGNAL_AT = "epoch.step")
    uninterrupted, and signalled then rerun: the two output files (argv[1])."""
    script = tmp_path / f"train{suffix}.py"
    script.write_text(text)
    ref = subprocess.run(
        [sys.executable, str(script), str(tmp_path / f"ref{suffix}")],
        env=env(tmp_path / "ref-home"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ref.returncode == 0, ref.stderr
    out = tmp_path / f"out{suffix}"
    signalled = env(tmp_path / ".hindsight", SIGNAL_AT=at, MARK=str(tmp_path / "signalled"))
    for code in (85, 0):
        r = subprocess.run(
            [sys.executable, str(script), str(out)], env=signalled, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == code, r.stderr
    return tmp_path / f"ref{suffix}", out


@pytest.mark.parametrize("at", ["1.5", "0.2", "2.6"])
def test_a_signal_between_two_optimizer_steps_resumes_the_accumulated_gradients(tmp_path, at):
    ref, out = interrupted_and_reference(tmp_path, ACCUMULATE, at, ".pt")
    want, got = torch.load(ref), torch.load(out)
    for k, t in want.items():
        assert torch.equal(got[k], t), k


OBJECTS = """\
import json, os, random, signal, sys
import numpy as np
import torch
import hindsight as hs


class AverageMeter:  # timm/utils/metrics.py's shape: changed through update()
    def __init__(self):
        self.sum, self.count, self.avg = 0.0, 0, 0.0

    def update(self, v, n=1):
        self.sum += v * n
        self.count += n
        self.avg = self.sum / self.count


class Env:  # a gymnasium-style environment with its own numpy Generator
    def __init__(self):
        self.np_random = np.random.default_rng(7)
        self.state = np.zeros(2)

    def step(self):
        self.state = self.state + self.np_random.normal(size=2)
        return float(self.state.sum())


class WarmupScheduler:  # not a torch LRScheduler: state through state_dict
    def __init__(self, optimizer):
        self.optimizer, self.t, self.base = optimizer, 0, optimizer.param_groups[0]["lr"]

    def step_update(self):
        self.t += 1
        self.optimizer.param_groups[0]["lr"] = self.base * min(1.0, self.t / 10)

    def state_dict(self):
        return {"t": self.t, "base": self.base}

    def load_state_dict(self, sd):
        self.t, self.base = sd["t"], sd["base"]


env = Env()


def train_one_epoch(epoch, net, opt, sched, py_rng):
    meter = AverageMeter()
    for step in hs.loop("step", range(6)):
        x = torch.full((4, 3), env.step()) + py_rng.random()
        loss = net(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step_update()
        meter.update(loss.item())
        hs.log("avg", meter.avg)
        if os.environ.get("SIGNAL_AT") == f"{epoch}.{step}" and not os.path.exists(os.environ["MARK"]):
            open(os.environ["MARK"], "w").close()
            os.kill(os.getpid(), signal.SIGUSR1)
    return meter.avg


def main():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    sched = WarmupScheduler(opt)
    py_rng = random.Random(3)
    history = []
    with hs.checkpointing():
        for epoch in hs.loop("epoch", range(3)):
            history.append(train_one_epoch(epoch, net, opt, sched, py_rng))
    out = {"history": history, "env": env.step(), "py": py_rng.random(), "t": sched.t,
           "w": net.weight.detach().flatten().tolist()}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


main()
"""


@pytest.mark.parametrize("at", ["1.3", "0.5", "2.0"])
def test_objects_a_loop_changes_through_methods_resume_in_place(tmp_path, at):
    """timm's AverageMeter, an environment's own numpy Generator (a module
    global the function's loop steps), a random.Random and a scheduler that
    only has a state_dict: a signal mid-run resumes all of them exactly."""
    ref, out = interrupted_and_reference(tmp_path, OBJECTS, at, ".json")
    want, got = json.loads(ref.read_text()), json.loads(out.read_text())
    assert got == want


# The DDP tutorial's single-process shape (pytorch/examples
# distributed/ddp-tutorial-series): a Trainer holding the model, the
# optimizer and the DataLoader on `self`, the loops in its methods, a
# counter and a history on `self`.
TRAINER = """\
import json, os, signal, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
import hindsight as hs


class Trainer:
    def __init__(self, model, train_data, optimizer):
        self.model, self.train_data, self.optimizer = model, train_data, optimizer
        self.steps_run, self.losses = 0, []

    def _run_epoch(self, epoch):
        for source, targets in hs.loop("step", self.train_data):
            self.optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(self.model(source), targets)
            loss.backward()
            self.optimizer.step()
            self.steps_run += 1
            self.losses.append(round(loss.item(), 6))
            if os.environ.get("SIGNAL_AT") == f"{epoch}.{self.steps_run % 4}" and not os.path.exists(os.environ["MARK"]):
                open(os.environ["MARK"], "w").close()
                os.kill(os.getpid(), signal.SIGUSR1)

    def train(self, max_epochs):
        for epoch in hs.loop("epoch", range(max_epochs)):
            self._run_epoch(epoch)


torch.manual_seed(0)
ds = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
trainer = Trainer(model, DataLoader(ds, batch_size=8, shuffle=True), opt)
with hs.checkpointing(model=model, optimizer=opt):
    trainer.train(3)
with open(sys.argv[1], "w") as f:
    json.dump({"steps": trainer.steps_run, "losses": trainer.losses, "w": model.weight.flatten().tolist()}, f)
"""


@pytest.mark.parametrize("at", ["1.2", "2.0"])
def test_a_trainer_holding_its_dataloader_on_self_resumes_its_counters(tmp_path, at):
    """`self` (changed through `self._run_epoch`) used to be left out whole
    because of its DataLoader: `steps_run` and `losses` restarted from the
    values the code before the loop made."""
    ref, out = interrupted_and_reference(tmp_path, TRAINER, at, ".json")
    want, got = json.loads(ref.read_text()), json.loads(out.read_text())
    assert want["steps"] == 12
    assert got == want


class Meter:
    def __init__(self) -> None:
        import collections

        import numpy as np

        self.vals: list[float] = []
        self.g = np.random.default_rng(1)
        self.t = torch.Generator().manual_seed(2)
        self.r = random.Random(3)
        self.big = 1 << 100
        self.od = collections.OrderedDict(a=1)
        self.by_int = {0: torch.ones(2)}
        self.scalars = (np.float64(0.25), np.int32(3))  # an environment's state tuple
        self.kind = signal.Signals.SIGTERM  # an Enum member (pytorch/examples imagenet's Summary)
        self.device, self.dtype = torch.device("cpu", 0), torch.bfloat16  # a Trainer's self.device


def test_object_state_round_trips_in_place_and_refuses_what_it_cannot_keep():
    import collections
    import io

    import numpy as np

    from hindsight._run import objstate

    m = Meter()
    m.vals.append(1.5)
    saved = objstate.encode(m)
    draws = (m.g.normal(), torch.rand(1, generator=m.t).item(), m.r.random())
    m.vals.append(9.0)
    m.by_int[0] = torch.zeros(2)  # (encode keeps tensors by reference: the store copies them)
    same = objstate.restore(m, saved, "m")
    assert same is m  # in place: other references see the restored state
    assert m.vals == [1.5] and m.big == 1 << 100 and isinstance(m.od, collections.OrderedDict)
    assert torch.equal(m.by_int[0], torch.ones(2))
    assert [(type(x), x) for x in m.scalars] == [(np.float64, 0.25), (np.int32, 3)]
    assert m.kind is signal.Signals.SIGTERM
    assert (m.device, m.dtype) == (torch.device("cpu", 0), torch.bfloat16)
    assert (m.g.normal(), torch.rand(1, generator=m.t).item(), m.r.random()) == draws
    # A fresh process has no such object yet: a plain instance is built.
    fresh = objstate.restore(objstate.MISSING, saved, "m")
    assert type(fresh) is Meter and fresh.vals == [1.5]
    assert (fresh.device, fresh.dtype) == (torch.device("cpu", 0), torch.bfloat16)

    class Holder:
        def __init__(self) -> None:
            self.f = io.StringIO()

    with pytest.raises(objstate.NotKept, match=r"_io.StringIO cannot be checkpointed \(in a .*Holder\)"):
        objstate.encode(Holder())
    loop: list = []
    loop.append(loop)
    with pytest.raises(objstate.NotKept, match="refers to itself"):
        objstate.encode(loop)


EVAL_FIRST = """\
import json, os, signal, sys
import torch
import hindsight as hs

torch.manual_seed(0)
net = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
x = torch.randn(16, 4)
with hs.checkpointing(model=net, optimizer=opt):
    for it in hs.loop("iter", range(4)):
        hs.log("eval", net(x).pow(2).mean().item())  # before the steps: nanoGPT's estimate_loss()
        for micro in hs.loop("micro", range(3)):
            loss = net(x[micro::3]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if os.environ.get("SIGNAL_AT") == f"{it}.{micro}" and not os.path.exists(os.environ["MARK"]):
                open(os.environ["MARK"], "w").close()
                os.kill(os.getpid(), signal.SIGUSR1)
with open(sys.argv[1], "w") as f:
    json.dump(net.weight.flatten().tolist(), f)
"""


def test_values_the_code_before_the_steps_logged_survive_a_resume_inside_the_steps(tmp_path):
    """The resume re-runs that code (it may make the data iterator) on the
    weights the process started with: what it logs again is no result (the
    zoo's nanoGPT: train_loss at iter 10 evaluated on initial weights)."""
    ref, out = interrupted_and_reference(tmp_path, EVAL_FIRST, "2.1", ".json")
    assert json.loads(ref.read_text()) == json.loads(out.read_text())

    def evals(home: Path) -> list[list[object]]:
        code = "import hindsight as hs\nprint(hs.dataframe('eval')[['iter', 'eval']].to_json(orient='values'))"
        r = subprocess.run([sys.executable, "-c", code], env=env(home), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    want = evals(tmp_path / "ref-home")
    assert [row[0] for row in want] == [0, 1, 2, 3]
    assert evals(tmp_path / ".hindsight") == want


TIED = """\
import os, signal
import torch
import torch.nn as nn
import hindsight as hs

torch.manual_seed(0)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as GPT-2's are

    def forward(self, x):
        return self.lm_head(self.wte(x))


model = Tiny()
if os.environ["WRAP"] == "compile":
    model = torch.compile(model, backend="eager")  # build-nanogpt: raw_model = model._orig_mod
    raw_model = model._orig_mod
else:
    raw_model = model
    model = nn.Sequential(model)  # a wrapper, as DDP is: raw_model = model.module
optimizer = torch.optim.AdamW(raw_model.parameters(), lr=1e-2)
with hs.checkpointing(model=model, optimizer=optimizer):
    for step in hs.loop("step", range(40)):
        x = torch.randint(0, 16, (4, 5))
        loss = model(x).logsumexp(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0:
            sd = raw_model.state_dict()  # build-nanogpt's checkpoint code reads it
        if step == 25 and os.environ.get("STOP") and not os.path.exists("stopped"):
            open("stopped", "w").close()
            os.kill(os.getpid(), signal.SIGTERM)
print("FINAL", repr(sum(p.double().sum().item() for p in model.parameters())))
"""


@pytest.mark.parametrize("wrap", ["module", "compile"])
def test_an_alias_of_a_wrapped_model_with_tied_weights_resumes_exactly(tmp_path: Path, wrap: str) -> None:
    """Issue 43: `raw_model = model.module` (build-nanogpt under DDP) or
    `model._orig_mod` (under torch.compile) with GPT-2's tied embedding, and
    an optimizer that holds the tied parameter once: the alias is kept as
    references into the checkpointed model, and the resume put them back
    through the live one (it failed: "'raw_model['wte.weight']' referred to
    a checkpointed object that the resumed program does not hold there")."""

    def run(d: Path, **env: str) -> subprocess.CompletedProcess[str]:
        d.mkdir(exist_ok=True)
        (d / "train.py").write_text(TIED)
        e = {**os.environ, "HINDSIGHT_HOME": str(d / ".hindsight"), "HINDSIGHT_CHECKPOINT_EVERY": "5", "WRAP": wrap}
        e.update(env)
        return subprocess.run([sys.executable, "train.py"], cwd=d, env=e, capture_output=True, text=True, timeout=120)

    ref = run(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr
    assert run(tmp_path / "job", STOP="1").returncode == 85
    resumed = run(tmp_path / "job")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continues from checkpoint" in resumed.stderr
    final = [line for line in resumed.stdout.splitlines() if line.startswith("FINAL")]
    assert final == [line for line in ref.stdout.splitlines() if line.startswith("FINAL")]

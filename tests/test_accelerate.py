"""Hugging Face Accelerate loops (hindsight.accelerate), with the real
library in real processes: recording, SIGTERM -> 85 -> exact resume (the
shuffled order of accelerate's default and seedable samplers, inside a
gradient-accumulation window), replay of an added probe, and
save_state/load_state into a store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import hindsight_cmd, run_py

pytest.importorskip("accelerate")

EPOCHS, STEPS = 3, 12  # 96 samples in batches of 8

SCRIPT = """\
import os
import signal

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn

import hindsight as hs
import hindsight.accelerate as hsa

seedable = hs.arg("seedable", False)
accum = hs.arg("accum", 1)
plain = hs.arg("plain", False)
scaler = hs.arg("scaler", False)
direct = hs.arg("direct", False)
out = hs.arg("out", "")
kill_at = os.environ.get("KILL_AT", "")

set_seed(0)
accelerator = Accelerator(
    cpu=True,
    gradient_accumulation_steps=accum,
    dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable),
)
g = torch.Generator().manual_seed(7)
x = torch.randn(96, 8, generator=g)
y = (x.sum(1) > 0).long()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)
if scaler:
    # The grad scaler accelerate makes for fp16 on a GPU (none on a CPU):
    # its scale grows every 4 steps, state a resume must carry.
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

with hs.checkpointing(every=1) if plain else hsa.checkpointing(accelerator, every=1):
    for epoch in hs.loop("epoch", range(3)):
        model.train()
        steps = enumerate(hs.loop("step", loader)) if direct else hs.loop("step", enumerate(loader))
        for step, (xb, yb) in steps:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            hs.log("loss", loss.item())
            if kill_at == f"{epoch},{step}":
                os.kill(os.getpid(), signal.SIGTERM)  # acted on at the step's end
        hs.log("lr", scheduler.get_last_lr()[0])

if out:
    final = {"model": accelerator.unwrap_model(model).state_dict()}
    if scaler:
        final["scale"] = accelerator.scaler.get_scale()
        final["growth"] = accelerator.scaler._get_growth_tracker()
    torch.save(final, out)
"""

# Probes a replay adds: one per step (reads the accumulated gradients), one per epoch.
STEP_PROBE = (
    "                accelerator.backward(loss)\n",
    "                accelerator.backward(loss)\n"
    '                hs.log("grad_norm", sum(p.grad.norm().item() ** 2 for p in model.parameters()) ** 0.5)\n',
)
EPOCH_PROBE = (
    '        hs.log("lr", scheduler.get_last_lr()[0])\n',
    '        hs.log("lr", scheduler.get_last_lr()[0])\n'
    '        hs.log("w_norm", sum(p.norm().item() ** 2 for p in model.parameters()) ** 0.5)\n',
)


def write_script(root: Path, *edits: tuple[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    src = SCRIPT
    for old, new in edits:
        assert old in src
        src = src.replace(old, new, 1)
    (root / "train.py").write_text(src)
    return root / "train.py"


def env_for(home: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "HINDSIGHT_HOME": str(home), **extra}


def run(script: Path, home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args],
        env=env_for(home, **env),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=script.parent,
    )


def logs(home: Path) -> tuple[str, list[tuple[str, str, int, Any]]]:
    """(status, [(name, ctx, rep, value)]) of the home's single run."""
    code = (
        "import json, os\nfrom hindsight import _native\n"
        "db = _native.LogDb(os.path.join(os.environ['HINDSIGHT_HOME'], 'logs.db'))\n"
        "runs = db.runs()\nassert len(runs) == 1, [r.id for r in runs]\n"
        "rows = [(r.name, json.dumps(r.ctx), r.rep, json.loads(r.value_json)) for r in db.logs(runs[0].id)\n"
        "        if r.phase == 'record']\n"
        "print(json.dumps({'status': runs[0].status, 'rows': rows}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env_for(home), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    return got["status"], [tuple(row) for row in got["rows"]]


def by_context(rows: list[tuple[str, str, int, Any]], name: str) -> dict[str, Any]:
    """{ctx: value} of `name`, each context logged exactly once."""
    out: dict[str, Any] = {}
    for n, ctx, rep, value in rows:
        if n == name:
            assert rep == 0 and ctx not in out, f"{name} logged twice at {ctx}"
            out[ctx] = value
    return out


CONFIGS = {
    # accelerate's default: a RandomSampler drawing from torch's global RNG
    "default": ((), "1,5"),
    # the seedable sampler orders each epoch by (seed + DataLoaderShard.iteration)
    "seedable": (("--seedable",), "2,3"),
    # interrupted inside an accumulation window: steps 2 and 3 make one optimizer step
    "accumulation": (("--accum", "2"), "1,2"),
    # the same with plain hs.checkpointing(): the Accelerator is a loop variable
    "plain-accumulation": (("--accum", "2", "--plain", "--seedable"), "1,2"),
    # a grad scaler (accelerate's fp16 on a GPU): its scale and growth tracker
    "scaler": (("--scaler",), "1,5"),
    # the prepared DataLoader itself in hs.loop (its state_dict works only over torchdata)
    "direct": (("--direct", "--seedable"), "1,5"),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Uninterrupted runs, one per config: final weights and logs, made on first use."""
    made: dict[str, Any] = {}

    def get(config: str) -> tuple[dict[str, torch.Tensor], list[tuple[str, str, int, Any]]]:
        if config not in made:
            root = tmp_path_factory.mktemp(f"ref-{config}")
            script = write_script(root)
            r = run(script, root / "home", *CONFIGS[config][0], "--out", str(root / "final.pt"))
            assert r.returncode == 0, r.stderr[-3000:]
            status, rows = logs(root / "home")
            assert status == "completed"
            made[config] = (torch.load(root / "final.pt"), rows)
        return made[config]

    return get  # type: ignore[return-value]


def test_an_accelerate_loop_is_recorded_per_epoch_and_step(references: Any) -> None:
    _, rows = references("default")
    loss = by_context(rows, "loss")
    assert sorted(loss) == sorted(json.dumps([["epoch", e], ["step", s]]) for e in range(EPOCHS) for s in range(STEPS))
    assert all(isinstance(v, float) for v in loss.values())
    lr = by_context(rows, "lr")
    assert lr == {
        json.dumps([["epoch", e]]): pytest.approx(1e-2 * 0.5 ** ((e + 1) * STEPS // 3)) for e in range(EPOCHS)
    }


@pytest.mark.parametrize("config", list(CONFIGS))
def test_sigterm_then_rerun_ends_bit_identical(references: Any, tmp_path: Path, config: str) -> None:
    args, kill_at = CONFIGS[config]
    ref_weights, ref_rows = references(config)
    script = write_script(tmp_path)
    home, out = tmp_path / "home", tmp_path / "final.pt"
    first = run(script, home, *args, "--out", str(out), KILL_AT=kill_at)
    assert first.returncode == 85, first.stderr[-3000:]
    assert "checkpointed run" in first.stderr and not out.exists()
    second = run(script, home, *args, "--out", str(out))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming run" in second.stderr
    final = torch.load(out)
    weights = final.pop("model")
    assert weights.keys() == ref_weights["model"].keys()
    for k, v in ref_weights["model"].items():
        assert torch.equal(weights[k], v), f"{config}: {k} differs from the uninterrupted run"
    assert final == {k: v for k, v in ref_weights.items() if k != "model"}
    if config == "scaler":
        assert final["scale"] == 2.0 ** (10 + EPOCHS * STEPS // 4)  # it grew: the check can fail
    status, rows = logs(home)
    assert status == "completed"
    # Every step's loss once, as the uninterrupted run logged it.
    assert by_context(rows, "loss") == by_context(ref_rows, "loss")
    assert by_context(rows, "lr") == by_context(ref_rows, "lr")


def test_replay_recomputes_added_probes(tmp_path: Path) -> None:
    # A run that logged the probes from the start says what replay must find.
    ref_root = tmp_path / "ref"
    ref = write_script(ref_root, STEP_PROBE, EPOCH_PROBE)
    r = run(ref, ref_root / "home", "--accum", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    _, ref_rows = logs(ref_root / "home")

    root = tmp_path / "proj"
    script = write_script(root)
    home = root / "home"
    r = run(script, home, "--accum", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    write_script(root, STEP_PROBE, EPOCH_PROBE)
    rep = subprocess.run(
        [*hindsight_cmd(), "replay", str(script), "-q", "-j", "2"],
        env=env_for(home),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=root,
    )
    assert rep.returncode == 0, rep.stdout[-2000:] + rep.stderr[-3000:]
    assert "DIVERGENCE" not in rep.stdout + rep.stderr
    code = (
        "import json, os\nfrom hindsight import _native\n"
        "db = _native.LogDb(os.path.join(os.environ['HINDSIGHT_HOME'], 'logs.db'))\n"
        "[run] = db.runs()\n"
        "print(json.dumps([(r.name, json.dumps(r.ctx), r.rep, json.loads(r.value_json))\n"
        "                  for r in db.logs(run.id, ['grad_norm', 'w_norm'])]))\n"
    )
    q = subprocess.run([sys.executable, "-c", code], env=env_for(home), capture_output=True, text=True, timeout=60)
    assert q.returncode == 0, q.stderr
    rows = [tuple(x) for x in json.loads(q.stdout)]
    for name, n in (("grad_norm", EPOCHS * STEPS), ("w_norm", EPOCHS)):
        got, want = by_context(rows, name), by_context(ref_rows, name)
        assert len(want) == n
        assert got == want, name


SAVE_LOAD = """\
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn

import hindsight as hs
import hindsight.accelerate as hsa


class Counter:  # a registered object: accelerate saves its state_dict
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, s):
        self.n = s["n"]


store_dir, seedable = sys.argv[1], sys.argv[2] == "1"
set_seed(0)
accelerator = Accelerator(
    cpu=True, gradient_accumulation_steps=2, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable)
)
g = torch.Generator().manual_seed(7)
x = torch.randn(40, 8, generator=g)
y = (x.sum(1) > 0).long()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
counter = Counter()
accelerator.register_for_checkpointing(counter)


def epoch():
    losses = []
    for xb, yb in loader:
        with accelerator.accumulate(model):
            loss = nn.functional.cross_entropy(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        counter.n += 1
        losses.append(loss.item())
    return losses


def weights():
    return [p.detach().clone() for p in model.parameters()]


epoch()
hsa.save_state(accelerator, store_dir, "after-epoch-0")
first = [epoch(), epoch()], weights(), counter.n, accelerator.step
hsa.load_state(accelerator, store_dir, "after-epoch-0")
assert counter.n == 5, counter.n
again = [epoch(), epoch()], weights(), counter.n, accelerator.step
assert first[0] == again[0], (first[0], again[0])
assert all(torch.equal(a, b) for a, b in zip(first[1], again[1]))
assert first[2:] == again[2:]

# A flipped byte in the stored checkpoint: refused, and nothing is applied.
chunks = sorted(p for p in (__import__("pathlib").Path(store_dir) / "chunks").rglob("*") if p.is_file())
for c in chunks:
    data = bytearray(c.read_bytes())
    data[len(data) // 2] ^= 0x40
    c.write_bytes(bytes(data))
before = weights()
try:
    hsa.load_state(accelerator, store_dir, "after-epoch-0")
except hs.CorruptError as e:
    print("refused:", e)
else:
    raise SystemExit("a corrupted checkpoint was loaded")
assert all(torch.equal(a, b) for a, b in zip(before, weights()))
assert counter.n == 15, counter.n
print("ok")
"""


@pytest.mark.parametrize("seedable", [False, True], ids=["default-sampler", "seedable-sampler"])
def test_save_state_load_state_round_trip_exactly_and_refuse_a_damaged_store(tmp_path: Path, seedable: bool) -> None:
    r = run_py(SAVE_LOAD, str(tmp_path / "store"), "1" if seedable else "0", timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "refused:" in r.stdout and r.stdout.rstrip().endswith("ok")


def test_more_than_one_process_is_refused(tmp_path: Path) -> None:
    r = run_py(
        """
        from accelerate import Accelerator
        import hindsight.accelerate as hsa

        acc = Accelerator(cpu=True)
        acc.state.num_processes = 2  # what a second rank would see
        with hsa.checkpointing(acc):
            pass
        """,
        env={"HINDSIGHT_HOME": str(tmp_path)},
    )
    assert r.returncode == 1
    assert "runs 2 processes" in r.stderr and "hindsight records and resumes one process" in r.stderr


def test_a_dispatching_dataloader_is_refused(tmp_path: Path) -> None:
    r = run_py(
        """
        import torch
        from accelerate import Accelerator
        from accelerate.utils import DataLoaderConfiguration
        import hindsight.accelerate as hsa

        acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
        acc.prepare(torch.utils.data.DataLoader(torch.arange(10), batch_size=2))
        with hsa.checkpointing(acc):
            pass
        """,
        env={"HINDSIGHT_HOME": str(tmp_path)},
    )
    assert r.returncode == 1
    assert "dispatch_batches=True (DataLoaderDispatcher) is not supported" in r.stderr

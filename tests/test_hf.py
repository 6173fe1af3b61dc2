"""hindsight.transformers: the Hugging Face Trainer callback, with real
transformers Trainer runs (a tiny GPT-2 built from a config, random token
ids, CPU) in real subprocesses and real signals. Skipped when transformers
is absent."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import hindsight_cmd

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

# Two epochs of 6 optimizer steps; dropout is on (GPT-2's default 0.1), the
# sampler shuffles, and an evaluation every 5 steps draws from the global
# torch generator (its DataLoader's base seed): a resume that missed any
# of these would not end with the same weights.
SCRIPT = """
import os, signal, sys, time
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
import hindsight as hs
from hindsight.transformers import HindsightCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Monitor(TrainerCallback):
    def on_step_end(self, args, state, control, model=None, **kw):
        print("step", state.global_step, flush=True)
        if state.global_step == int(os.environ.get("SIGNAL_AT", "-1")):
            os.kill(os.getpid(), signal.SIGTERM)  # checkpoint at the next step boundary, exit 85
        time.sleep(float(os.environ.get("PAUSE", "0")))

    def on_epoch_end(self, args, state, control, model=None, **kw):
        print("epoch", state.epoch, flush=True)


def compute_metrics(pred):
    hs.log("eval_hook", 1.0)  # hs.log in Trainer's hooks lands in Trainer's context
    return {}


torch.manual_seed(0)
config = AutoConfig.for_model("gpt2", n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
model = AutoModelForCausalLM.from_config(config)
args = TrainingArguments(
    output_dir="out", num_train_epochs=2, per_device_train_batch_size=4, logging_steps=1, save_strategy=os.environ.get("SAVE_STRATEGY", "no"), metric_for_best_model="loss",
    report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, eval_strategy="steps",
    eval_steps=5, ignore_data_skip=bool(os.environ.get("IGNORE_DATA_SKIP")), max_steps=int(os.environ.get("MAX_STEPS", "-1")),
)
every = int(os.environ.get("EVERY_STEPS", "0")) or None
best = int(os.environ.get("KEEP_BEST", "0")) or None
cb = HindsightCallback(every_n_train_steps=every, keep_last=int(os.environ.get("KEEP_LAST", "0")) or None,
                       keep_best=best, monitor="eval_loss" if best else None, mode=os.environ.get("BEST_MODE", "min"))
trainer = Trainer(model=model, args=args, train_dataset=Tokens(24, int(os.environ.get("DATA_SEED", "1"))), eval_dataset=Tokens(8, 2),
                  compute_metrics=compute_metrics, callbacks=[cb, Monitor()])
trainer.train(resume_from_checkpoint=cb.resume_from_checkpoint())
if os.environ.get("TRAIN_TWICE"):
    trainer.train()
torch.save(model.state_dict(), "final.pt")
print("done", trainer.state.global_step, flush=True)
"""
STEPS = 12
PER_EPOCH = 6


def _env(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HINDSIGHT_EXIT_CODE", "_CONDOR_JOB_AD", "SLURM_JOB_ID")}
    return {
        **env,
        "HINDSIGHT_HOME": str(root / "home"),
        "TMPDIR": str(root / "tmp"),
        "TOKENIZERS_PARALLELISM": "false",
        **extra,
    }


def _project(root: Path, src: str = SCRIPT) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tmp").mkdir(exist_ok=True)
    (root / "train.py").write_text(src)
    return root


def _run(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "train.py"], cwd=root, env=_env(root, **env), capture_output=True, text=True, timeout=240
    )


def _values(home: Path, run: str | None = None) -> tuple[list[dict[str, Any]], dict[str, dict[tuple, tuple[Any, Any]]]]:
    """The project's runs, and {name: {(ctx..., rep): (recorded, replayed)}} of
    run `run` (default: its first run)."""
    from hindsight import _native

    db = _native.LogDb(str(home / "logs.db"))
    runs = db.runs()
    if run is None and runs:
        run = runs[0].id
    out: dict[str, dict[tuple, tuple[Any, Any]]] = {}
    for v in db.values(run) if run else []:
        out.setdefault(v.name, {})[(*v.ctx, v.rep)] = (
            None if v.recorded is None else json.loads(v.recorded),
            None if v.replayed is None else json.loads(v.replayed),
        )
    return runs, out


def _prefix(root: Path) -> str:
    """The checkpoint prefix of the project's only run."""
    runs, _ = _values(root / "home")
    assert len(runs) == 1
    return f"transformers.{runs[0].id}"


def _recorded(values: dict[str, dict[tuple, tuple[Any, Any]]], name: str) -> dict[tuple, Any]:
    return {c: v[0] for c, v in values[name].items() if v[0] is not None}


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = torch.load(a), torch.load(b)
    assert list(wa) == list(wb)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SCRIPT uninterrupted: one run, Trainer's values at (epoch, step)."""
    root = _project(tmp_path_factory.mktemp("hf-ref"))
    r = _run(root)
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def test_record_gives_one_run_with_trainer_values_at_epoch_and_step(reference: Path) -> None:
    import hindsight as hs

    runs, values = _values(reference / "home")
    assert len(runs) == 1 and runs[0].status == "completed"
    loss = _recorded(values, "loss")
    # one loss per optimizer step, numbered as Trainer numbers them, in its epoch
    assert sorted(loss) == [(("epoch", (s - 1) // PER_EPOCH), ("step", s), 0) for s in range(1, STEPS + 1)]
    assert all(isinstance(v, float) for v in loss.values())
    assert sorted(_recorded(values, "learning_rate")) == sorted(loss)
    assert sorted(_recorded(values, "grad_norm")) == sorted(loss)
    evals = [(("epoch", (s - 1) // PER_EPOCH), ("step", s), 0) for s in (5, 10, 12)]  # and at the end
    assert sorted(_recorded(values, "eval_loss")) == evals
    assert sorted(_recorded(values, "eval_hook")) == evals  # hs.log in compute_metrics: the same context
    # train()'s summary at its end; not its train_loss (a mean over the call's steps, which a resume changes)
    assert list(_recorded(values, "total_flos")) == [(("epoch", 1), ("step", STEPS), 0)]
    assert "train_loss" not in values and "train_runtime" not in values and "eval_runtime" not in values

    # The checkpoints are in the project's store: one per epoch, and the mark of a finished train().
    store = hs.Store(reference / "home" / "store")
    # named after the run: a relaunch continuing it resumes them, another run never does
    p = _prefix(reference)
    assert store.list() == [f"{p}.epoch-000000", f"{p}.epoch-000001", f"{p}.epoch-000001.end"]
    assert store.verify() == []
    info = store.info(f"{p}.epoch-000000")
    assert info["meta"]["global_step"] == str(PER_EPOCH)
    files = {e["path"] for e in store.load(f"{p}.epoch-000000")["files"]}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= files
    ckpt = store.load(f"{p}.epoch-000000")
    state = json.loads(next(e["data"] for e in ckpt["files"] if e["path"] == "trainer_state.json"))
    assert state["global_step"] == PER_EPOCH and state["epoch"] == 1.0
    # Trainer's own files of the checkpoint hindsight asked for are gone (save_strategy="no").
    assert not list((reference / "out").glob("checkpoint-*"))
    assert (reference / "final.pt").exists()


def _check_resumed(root: Path, reference: Path, run: str | None = None) -> None:
    _same_weights(root / "final.pt", reference / "final.pt")
    runs, values = _values(root / "home", run)
    _, want = _values(reference / "home")
    if run is None:
        assert len(runs) == 1
    # the relaunch continued the same run
    assert [r.status for r in runs if r.id == (run or runs[0].id)] == ["completed"]
    assert sorted(values) == sorted(want)
    for name in values:
        # each step's value once (rep 0 only), equal to the uninterrupted run's
        assert _recorded(values, name) == _recorded(want, name), name
    assert not list((root / "tmp").glob("hindsight-*"))  # the resumed checkpoint's directory was removed


def test_sigterm_from_outside_exits_85_and_the_relaunch_resumes_bit_identically(
    reference: Path, tmp_path: Path
) -> None:
    import hindsight as hs

    root = _project(tmp_path / "p")
    proc = subprocess.Popen(
        [sys.executable, "train.py"],
        cwd=root,
        env=_env(root, PAUSE="0.2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if line.strip() == "step 8":  # mid-epoch 1
                proc.send_signal(signal.SIGTERM)
                break
            assert time.monotonic() < deadline
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 85, err[-3000:]
    names = hs.Store(root / "home" / "store").list()
    mid = [n for n in names if ".step-" in n]
    assert len(mid) == 1 and mid[0].startswith(f"{_prefix(root)}.epoch-000001.step-0000000"), names
    step = int(mid[0].rsplit("-", 1)[1])
    assert 8 <= step < STEPS
    assert f"checkpointed {mid[0]}; exiting with 85" in err
    runs, _ = _values(root / "home")
    assert runs[0].status == "interrupted"

    again = _run(root)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming Trainer from {mid[0]} (global step {step})" in again.stdout
    steps = [line for line in again.stdout.splitlines() if line.startswith("step ")]
    assert steps[0] == f"step {step + 1}" and steps[-1] == f"step {STEPS}"  # resumed at the next step
    _check_resumed(root, reference)


def test_a_finished_train_is_trained_afresh_by_the_next_run(reference: Path, tmp_path: Path) -> None:
    import hindsight as hs

    root = tmp_path / "p"
    shutil.copytree(reference, root)
    # keep_best ranks each epoch by the last eval_loss logged before its end
    # (steps 5 and 12): the mode that makes the last epoch the best one.
    _, values = _values(reference / "home")
    evals = _recorded(values, "eval_loss")
    at_end = [evals[(("epoch", 0), ("step", 5), 0)], evals[(("epoch", 1), ("step", 12), 0)]]
    assert at_end[0] != at_end[1]
    mode = "min" if at_end[1] < at_end[0] else "max"
    # Run again, now finished: a new run and a new train() from scratch under a
    # prefix of its own (with keep_best=1 this time).
    fresh = _run(root, KEEP_BEST="1", BEST_MODE=mode)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "resuming" not in fresh.stdout + fresh.stderr and fresh.stdout.splitlines()[0] == "step 1"
    _same_weights(root / "final.pt", reference / "final.pt")
    runs, _ = _values(root / "home")
    assert len(runs) == 2
    old = _prefix(reference)
    (new,) = {f"transformers.{r.id}" for r in runs} - {old}
    store = hs.Store(root / "home" / "store")
    assert sorted(store.list()) == sorted(
        [
            f"{old}.epoch-000000",
            f"{old}.epoch-000001",
            f"{old}.epoch-000001.end",
            # the new train()'s epoch 0 is removed: not the best, not the newest
            f"{new}.epoch-000001",
            f"{new}.epoch-000001.end",
        ]
    )
    assert store.info(f"{new}.epoch-000001")["meta"]["metric"] == repr(at_end[1])


def test_a_signal_at_an_epochs_last_step_resumes_at_the_next_epoch(reference: Path, tmp_path: Path) -> None:
    root = _project(tmp_path / "p")
    first = _run(root, SIGNAL_AT=str(PER_EPOCH))
    assert first.returncode == 85, first.stderr[-3000:]
    # Acted on at the epoch's end: the epoch checkpoint, after the epoch's evaluation and logs.
    assert f"checkpointed {_prefix(root)}.epoch-000000; exiting with 85" in first.stderr
    assert "epoch 1.0" in first.stdout
    interrupted = _prefix(root).split(".", 1)[1]
    # The same script with another argument is another run: it trains afresh,
    # and leaves the interrupted run's checkpoints alone.
    other = subprocess.run(
        [sys.executable, "train.py", "--other"], cwd=root, env=_env(root), capture_output=True, text=True, timeout=240
    )
    assert other.returncode == 0, other.stderr[-3000:]
    assert "resuming" not in other.stdout + other.stderr and other.stdout.splitlines()[0] == "step 1"
    again = _run(root)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming run {interrupted}" in again.stderr
    assert next(line for line in again.stdout.splitlines() if line.startswith("step ")) == f"step {PER_EPOCH + 1}"
    _check_resumed(root, reference, interrupted)


def test_a_signal_at_the_last_step_of_a_max_steps_run_ending_mid_epoch_lets_it_finish(tmp_path: Path) -> None:
    """Trainer resumed at max_steps inside an epoch trains one step more:
    a signal there lets the run finish (exit 0) instead of leaving a
    checkpoint whose resume would overtrain. With step checkpoints and retention."""
    import hindsight as hs

    root = _project(tmp_path / "p")
    r = _run(root, MAX_STEPS="9", SIGNAL_AT="8", EVERY_STEPS="4", KEEP_LAST="1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exiting with 85" not in r.stderr and "done 9" in r.stdout
    runs, values = _values(root / "home")
    assert runs[0].status == "completed"
    assert sorted(_recorded(values, "loss")) == [
        (("epoch", (s - 1) // PER_EPOCH), ("step", s), 0) for s in range(1, 10)
    ]
    # every_n_train_steps=4 saved after steps 4 and 8; keep_last=1 left the last epoch's
    # checkpoint (mid-epoch ones go once an epoch-end one of their epoch or a later one exists)
    store = hs.Store(root / "home" / "store")
    p = _prefix(root)
    assert store.list() == [f"{p}.epoch-000001", f"{p}.epoch-000001.end"]
    assert store.info(f"{p}.epoch-000001")["meta"]["global_step"] == "9"


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"IGNORE_DATA_SKIP": "1"}, "ignore_data_skip=True"),
        ({"SAVE_STRATEGY": "best"}, "save_strategy='best'"),
        # its values and epochs would overwrite the first train()'s in the same run
        ({"TRAIN_TWICE": "1", "MAX_STEPS": "2"}, "records one train() per process"),
    ],
)
def test_uses_that_defeat_an_exact_record_or_resume_are_refused_naming_them(
    tmp_path: Path, env: dict[str, str], named: str
) -> None:
    root = _project(tmp_path / "p")
    r = _run(root, **env)
    assert r.returncode == 1
    assert "InvalidArgumentError" in r.stderr and named in r.stderr, r.stderr[-3000:]
    steps = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert steps == (["step 1", "step 2"] if "TRAIN_TWICE" in env else [])  # refused when train() starts


def test_bad_arguments_name_the_argument(tmp_path: Path) -> None:
    from hindsight.errors import InvalidArgumentError
    from hindsight.transformers import HindsightCallback

    for kwargs, named in (
        ({"every_n_epochs": 0}, "every_n_epochs=0"),
        ({"every_n_train_steps": 2.5}, "every_n_train_steps=2.5"),
        ({"prefix": ".hidden"}, "prefix"),
        ({"exit_code": 300}, "exit_code=300"),
        ({"store": 7}, "store=7"),
        ({"keep_best": 1}, "monitor"),
        ({"keep_last": 0}, "keep_last"),
        ({"keep_best": 1, "monitor": "eval_loss", "mode": "lowest"}, "mode"),
    ):
        with pytest.raises(InvalidArgumentError, match=named):
            HindsightCallback(**{"store": tmp_path / "store", **kwargs})
    with pytest.raises(AttributeError, match="HindsightCheckpoint"):
        import hindsight.transformers as ht

        ht.HindsightCheckpoint  # noqa: B018 - the error names the missing attribute


# -- replay ---------------------------------------------------------------------------------------
PROBES = (
    (
        '        print("epoch", state.epoch, flush=True)\n',
        '        hs.log("wte_end", model.transformer.wte.weight.double().sum().item())\n',
    ),
    (
        '        print("step", state.global_step, flush=True)\n',
        '        hs.log("wte_step", model.transformer.wte.weight.double().sum().item())\n',
    ),
)


def _probed(*probes: tuple[str, str]) -> str:
    src = SCRIPT
    for anchor, line in probes:
        assert anchor in src
        src = src.replace(anchor, anchor + line, 1)
    return src


def test_replay_recomputes_added_probes_from_checkpoints(reference: Path, tmp_path: Path) -> None:
    """Probes added to a Trainer callback's on_epoch_end (epoch level) and
    on_step_end (step level) of a recorded run: `hindsight replay -j 2`
    re-executes the epochs, the second worker from the first epoch's
    checkpoint, with Trainer's recorded values (loss, learning rate, ...)
    as the oracle of the replayed ones; the probes' values are the weights
    the recording checkpointed and ended with."""
    import hindsight as hs

    proj = tmp_path / "proj"
    shutil.copytree(reference, proj)  # a copied project replays from its own copy
    (proj / "train.py").write_text(_probed(*PROBES))
    rep = subprocess.run(
        [*hindsight_cmd(), "replay", "train.py", "-q", "-j", "2"],
        cwd=proj,
        env=_env(proj),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert rep.returncode == 0, rep.stdout + rep.stderr[-3000:]
    assert "1 restored from checkpoints" in rep.stdout, rep.stdout
    _, got = _values(proj / "home")
    end = {c: v[1] for c, v in got["wte_end"].items() if v[1] is not None}
    step = {c: v[1] for c, v in got["wte_step"].items() if v[1] is not None}
    assert sorted(step) == [(("epoch", (s - 1) // PER_EPOCH), ("step", s), 0) for s in range(1, STEPS + 1)]
    store = hs.Store(proj / "home" / "store")

    def wte(tensors: dict[str, Any]) -> float:
        return float(tensors["transformer.wte.weight"].double().sum().item())

    final = wte(torch.load(reference / "final.pt"))
    p = _prefix(reference)
    for epoch, name in enumerate([f"{p}.epoch-000000", f"{p}.epoch-000001"]):
        ckpt = store.load(name)
        model = next(e["tensors"] for e in ckpt["files"] if e["path"] == "model.safetensors")
        at = (("epoch", epoch), ("step", PER_EPOCH * (epoch + 1)), 0)
        assert end[at] == step[at] == wte(model), name
    assert end[(("epoch", 1), ("step", STEPS), 0)] == final


def test_a_replay_that_trains_on_other_data_fails_naming_the_difference(reference: Path, tmp_path: Path) -> None:
    """The recorded values are the replay's oracle: a worker whose training
    differs from the recording's (here its data) stops with the divergence
    exit status, naming the first difference, and keeps no probe value."""
    proj = tmp_path / "proj"
    shutil.copytree(reference, proj)
    (proj / "train.py").write_text(_probed(PROBES[0]))
    rep = subprocess.run(
        [*hindsight_cmd(), "replay", "train.py", "-q"],
        cwd=proj,
        env=_env(proj, DATA_SEED="5"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert rep.returncode == 3, rep.stdout + rep.stderr[-3000:]
    # Caught at the first epoch's end (its weights against the checkpoint) or by its values.
    out = rep.stdout + rep.stderr
    assert "diverged from the recording" in out and (
        f"after epoch 0, the state differs from the recorded checkpoint {_prefix(reference)}.epoch-000000" in out
        or "loss at epoch=0, step=1: recorded" in out
    ), out[-3000:]
    _, got = _values(proj / "home")
    assert all(v[1] is None for v in got.get("wte_end", {}).values())

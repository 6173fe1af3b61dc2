#!/usr/bin/env python3
"""The zoo: hindsight's acceptance suite of public training scripts.

Each script in this directory is a public training script (pytorch/examples,
nanoGPT, minGPT, timm, ...) adapted minimally the way the README tells a user
(hs.loop, hs.checkpointing, hs.log, hs.args), with seeded synthetic data. This
driver runs each of them as a user would and checks three things:

resume    An uninterrupted run is the reference. Then a run is stopped at one
          step (SIGTERM, SIGUSR1 or kill -9, sent by the script to itself from
          `zoo_hook.step` at exactly that step) and relaunched with the same
          command until it completes (exit 85, or a kill, means run it again).
          Its final state (`zoo_hook.final`: weights, optimizer, ...) and every
          logged value must be bit-identical to the reference's. Steps: one
          random step per signal (the seed and the step are printed), and the
          boundaries: the first step, the last step of the first epoch, the
          last step of the run (SIGTERM and kill -9 each).
replay    Probe statements are inserted at the script's `# zoo: <kind>-probe:
          <expr>` comments (`hs.log("zoo_<kind>", <expr>)`); each kind is
          replayed into the recorded run with `-j 1` and `-j 2` and its values
          compared with those of a run that had the probe from the start.
          Kinds: `epoch` (outer loop), `step` (inside the steps), `rng` (a
          probe that draws from the random stream: the README says such a
          probe is refused).
overhead  Wall time of the recorded run vs the plain script (hindsight replaced
          by a no-op shim placed first on sys.path) and of each replay; the
          plain run's final state must equal the recorded one's
          ("transparent": recording does not change what the script computes).

Results: PASS; REFUSED (nonzero exit with a message from hindsight: the
message is kept); WRONG (exit 0 but a value or the final state differs, or
values are missing); ERROR (a crash that is not a hindsight refusal: a
traceback from elsewhere, a hang, a signal that did not stop the run). The
driver prints a table scripts x checks, then every non-PASS case with its
details, and exits 1 if any check is WRONG or ERROR.

    python tests/zoo/driver.py --all
    python tests/zoo/driver.py mnist dcgan --checks resume --seed 3
    python tests/zoo/driver.py --all --quick        # one signal per script, -j 2 replays only

Every run gets its own project home ($HINDSIGHT_HOME) under --workdir (a
temporary directory, removed at the end unless --keep). All runs use
$HINDSIGHT_CHECKPOINT_EVERY=1 (epochs of a few steps: the adaptive policy
would rightly checkpoint almost never), kill -9 runs also
$HINDSIGHT_SAFETY_MINUTES=0.005 (a safety checkpoint every ~0.3 s).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ZOO = Path(__file__).resolve().parent
PROBE_RE = re.compile(r"^(?P<indent>\s*)# zoo: (?P<kind>[a-z]+)-probe: (?P<expr>.+?)\s*$")
MARK_RE = re.compile(r"^zoo-step (\S+)$", re.M)


@dataclass(frozen=True)
class Spec:
    """A zoo script and the arguments of its full-size and CI-size runs."""

    file: str
    args: tuple[str, ...] = ()
    small: tuple[str, ...] = ()  # tests/test_zoo.py (CI): a smaller run of the same shape
    note: str = ""


SCRIPTS: dict[str, Spec] = {
    "mnist": Spec("mnist.py", (), ("--epochs", "2", "--train-size", "320")),
    "word_language_model": Spec(
        "word_language_model.py", (), ("--epochs", "3", "--tokens", "3000"), note="torch.save(model) of the best model"
    ),
    "dcgan": Spec(
        "dcgan.py",
        ("--dataset", "fake", "--manualSeed", "999"),
        ("--dataset", "fake", "--manualSeed", "999", "--niter", "2", "--fakeSize", "96"),
        note="enumerate(dataloader) with shuffle and num_workers=2",
    ),
    "vae": Spec("vae.py", (), ("--epochs", "3", "--train-size", "384")),
    "time_sequence_prediction": Spec(
        "time_sequence_prediction.py", (), ("--steps", "4", "--max-iter", "5"), note="LBFGS closure, one loop"
    ),
    "siamese_network": Spec("siamese_network.py", (), ("--epochs", "2", "--train-size", "256")),
    "imagenet": Spec(
        "imagenet.py", (), ("--epochs", "3", "--train-size", "256"), note="AverageMeter, num_workers=2, StepLR"
    ),
    "reinforce": Spec(
        "reinforce.py",
        (),
        (
            "--max-episodes",
            "30",
        ),
        note="itertools.count, episode loop only",
    ),
    "nanogpt": Spec(
        "nanogpt.py", (), ("--max_iters=12", "--eval_interval=5"), note="iteration loop, micro-step accumulation"
    ),
    "timm_train": Spec(
        "timm_train.py", (), ("--epochs", "2", "--train-size", "224"), note="EMA, NativeScaler, hands-free"
    ),
    "iterable_dataset": Spec(
        "iterable_dataset.py", (), ("--epochs", "3", "--examples", "256"), note="IterableDataset, 2 workers"
    ),
    "mingpt_trainer": Spec(
        "mingpt_trainer.py",
        (),
        (
            "--max_iters",
            "50",
        ),
        note="loop in a method, next(data_iter)",
    ),
    "accelerate_nlp": Spec(
        "accelerate_nlp.py",
        (),
        ("--num_epochs", "2", "--train_size", "96"),
        note="hindsight.accelerate, gradient accumulation by hand",
    ),
    "hf_trainer": Spec(
        "hf_trainer.py",
        (),
        ("--train_texts", "40", "--num_train_epochs", "2"),
        note="transformers.Trainer with HindsightCallback (run_clm shape)",
    ),
}

PASS, REFUSED, WRONG, ERROR, SKIP = "PASS", "REFUSED", "WRONG", "ERROR", "-"
SIGNALS = ("TERM", "USR1", "KILL")
RUN_TIMEOUT = 300.0
# Threads of every script run (OMP_NUM_THREADS); `--threads 0` leaves the
# environment alone. One thread: the zoo's models are tiny, and the shared
# 2-core machines it runs on make oversubscribed intra-op threads spin for
# seconds. Replay sets its workers' threads itself (cores / -j).
THREADS = {"n": 1}


@dataclass
class Outcome:
    status: str
    detail: str = ""
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def short(self) -> str:
        return self.status


@dataclass
class Proc:
    rc: int
    stdout: str
    stderr: str
    seconds: float  # wall
    cpu: float = 0.0  # user + system of the process and its children (DataLoader workers, replay workers)

    @property
    def markers(self) -> list[str]:
        return MARK_RE.findall(self.stdout)


# --------------------------------------------------------------------------- files
def probes_of(source: str) -> dict[str, str]:
    """{kind: expression} of the script's `# zoo: <kind>-probe: <expr>` comments."""
    out = {}
    for line in source.splitlines():
        m = PROBE_RE.match(line)
        if m:
            out[m["kind"]] = m["expr"]
    return out


def with_probes(source: str, kinds: tuple[str, ...]) -> str:
    """The script with `hs.log("zoo_<kind>", <expr>)` in place of the chosen probe comments."""
    lines = []
    for line in source.splitlines(keepends=True):
        m = PROBE_RE.match(line)
        if m and m["kind"] in kinds:
            line = f'{m["indent"]}hs.log("zoo_{m["kind"]}", {m["expr"]})\n'
        lines.append(line)
    return "".join(lines)


def prepare(d: Path, spec: Spec, probes: tuple[str, ...] = ()) -> Path:
    """A project directory holding the script (with `probes` inserted) and the hook."""
    d.mkdir(parents=True, exist_ok=True)
    src = (ZOO / spec.file).read_text()
    (d / spec.file).write_text(with_probes(src, probes))
    shutil.copy(ZOO / "zoo_hook.py", d / "zoo_hook.py")
    return d / spec.file


SHIM = '''"""A no-op stand-in for hindsight (the zoo driver's plain runs)."""
import contextlib, json, sys

_T, _F = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def arg(name, default):
    argv, flag, raw = sys.argv[1:], "--" + name, None
    for i, a in enumerate(argv):
        if a == flag:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if isinstance(default, bool) and (nxt is None or nxt.startswith("--") or nxt.lower() not in _T + _F):
                raw = "true"
            else:
                raw = nxt
        elif a.startswith(flag + "="):
            raw = a[len(flag) + 1:]
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.lower() in _T
    if isinstance(default, (int, float, str)):
        return type(default)(raw)
    return json.loads(raw)


def args(parser, argv=None):
    return parser.parse_args(argv)


def log(name, value):
    return value


def loop(name, iterable):
    return iter(iterable)


@contextlib.contextmanager
def checkpointing(**kwargs):
    yield


def run_id():
    return ""
'''

# hindsight.accelerate in the plain runs: its checkpointing is a no-op too.
SHIM_ACCELERATE = """import contextlib


@contextlib.contextmanager
def checkpointing(accelerator, **kwargs):
    yield
"""


# The Trainer callback of hindsight.transformers, doing nothing (hf_trainer.py).
SHIM_TRANSFORMERS = '''"""A no-op stand-in for hindsight.transformers."""
from transformers import TrainerCallback


class HindsightCallback(TrainerCallback):
    def __init__(self, *args, **kwargs):
        pass

    def resume_from_checkpoint(self):
        return None
'''


def shim_dir(work: Path) -> Path:
    d = work / "shim"
    (d / "hindsight").mkdir(parents=True, exist_ok=True)
    (d / "hindsight" / "__init__.py").write_text(SHIM)
    (d / "hindsight" / "accelerate.py").write_text(SHIM_ACCELERATE)
    (d / "hindsight" / "transformers.py").write_text(SHIM_TRANSFORMERS)
    return d


# --------------------------------------------------------------------------- processes
def base_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZOO_", "HINDSIGHT_"))}
    env.update(HINDSIGHT_HOME=str(home), HINDSIGHT_CHECKPOINT_EVERY="1", PYTHONUNBUFFERED="1")
    if THREADS["n"]:
        env.update(OMP_NUM_THREADS=str(THREADS["n"]), MKL_NUM_THREADS=str(THREADS["n"]))
    env.update(extra)
    return env


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = RUN_TIMEOUT) -> Proc:
    t0 = time.perf_counter()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc = -999
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (
            e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        ) + f"\n[zoo] timed out after {timeout} s"
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return Proc(rc, out, err, time.perf_counter() - t0, cpu)


def run_script(script: Path, spec_args: tuple[str, ...], home: Path, **env: str) -> Proc:
    return run([sys.executable, script.name, *spec_args], script.parent, base_env(home, **env))


def keep(d: Path, k: int, p: Proc) -> None:
    """A launch's output, kept beside its project for a look after the run (--keep)."""
    (d / f"launch-{k}.out").write_text(p.stdout)
    (d / f"launch-{k}.err").write_text(p.stderr)


def hindsight_cli(*args: str, cwd: Path, home: Path) -> Proc:
    return run([sys.executable, "-m", "hindsight", *args], cwd, base_env(home))


def failure(p: Proc, what: str) -> Outcome:
    """REFUSED when hindsight said why (a hindsight exception, or the CLI's
    `error: ...` line), ERROR otherwise (another exception, a usage error of
    the script, a hang, a death by signal)."""
    if p.rc == -999:
        return Outcome(ERROR, f"{what}: hang ({p.stderr.strip().splitlines()[-1]})")
    err = p.stderr.strip()
    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
    if p.rc == 3 and ("DIVERGENCE" in err or "DivergenceError" in err or "diverged from the recording" in err):
        # The replay checked itself against the recording and kept nothing.
        first = next((ln for ln in lines if ln.startswith("DIVERGENCE") or "diverged from the" in ln), excerpt(err, 2))
        return Outcome(REFUSED, f"{what}: exit 3, divergence detected: {first[:600]}", extra={"diverged": True})
    tracebacks = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if tracebacks:
        # The exception line ends the last traceback (a worker's, inside the replay's report).
        after = [ln for ln in lines[tracebacks[-1] + 1 :] if not ln.startswith(("File ", "^", "~"))]
        exc = next((ln for ln in after if re.match(r"^[\w.]+(Error|Exception|Refused|Exit)\b.*", ln)), "")
        ok = bool(exc) and _is_hindsight_exception(exc)
    else:
        ok = any(ln.startswith(("error: ", "hindsight: ", "hindsight replay: ")) for ln in lines)
    status = REFUSED if ok and p.rc > 0 else ERROR
    said = excerpt(err)
    if not tracebacks:
        # The CLI's reason: its `error:` line and the lines that name the statement.
        at = next((i for i, ln in enumerate(lines) if ln.startswith("error: ")), None)
        if at is not None:
            said = " | ".join(ln[:400] for ln in lines[at : at + 3])
    o = Outcome(status, f"{what}: exit {p.rc}: {said}")
    if status == REFUSED and "DivergenceError" in err:
        o.extra["diverged"] = True
    return o


def _is_hindsight_exception(line: str) -> bool:
    name = line.split(":", 1)[0].rsplit(".", 1)[-1]
    try:
        import hindsight.errors as errors
    except ImportError:
        return False
    cls = getattr(errors, name, None)
    return isinstance(cls, type) and issubclass(cls, errors.HindsightError)


def excerpt(text: str, lines: int = 5, width: int = 300) -> str:
    """The last lines of an output, without progress markers and traceback carets."""
    kept = [
        ln.strip()
        for ln in text.splitlines()
        if ln.strip() and not ln.startswith("zoo-step") and not set(ln.strip()) <= set("^~ ")
    ]
    return " | ".join(ln[:width] for ln in kept[-lines:])


# --------------------------------------------------------------------------- results
def run_ids(home: Path) -> list[str]:
    from hindsight import _native

    db = _native.LogDb(str(home / "logs.db"))
    return [r.id for r in sorted(db.runs(), key=lambda r: r.started_ms)]


def logged(home: Path) -> dict[str, Any]:
    """Every value of the home's single run: {(name, ctx, rep): (recorded, replayed)}, plus its status."""
    from hindsight import _native

    db = _native.LogDb(str(home / "logs.db"))
    runs = db.runs()
    if len(runs) != 1:
        return {"error": f"{len(runs)} runs in the project home (expected 1): " + ", ".join(r.status for r in runs)}
    run_id = runs[0].id
    vals, flags = {}, {}
    for v in db.values(run_id):
        key = (v.name, json.dumps(v.ctx), v.rep)
        vals[key] = (v.recorded, v.replayed)
        flag = getattr(v, "replay_flag", None)  # "exact", "inexact", "diverged" (newer engines)
        if flag:
            flags[key] = flag
    return {"run": run_id, "status": runs[0].status, "values": vals, "flags": flags}


def load_state(path: Path) -> Any:
    import torch

    return torch.load(path, weights_only=False)


def state_diff(a: Any, b: Any, where: str = "") -> str | None:
    """Where two saved states differ (bit for bit), or None."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: tensor vs {type(b).__name__ if isinstance(a, torch.Tensor) else type(a).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        x, y = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
        if x.dtype == torch.bool or x.element_size() == 1:
            same = torch.equal(x, y)
        else:
            same = torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        if not same:
            d = (a.double() - b.double()).abs().max().item() if a.is_floating_point() else "?"
            return f"{where}: values differ (max abs diff {d})"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{where}: keys {sorted(map(str, set(a) ^ set(b)))[:4]} only on one side"
        for k in a:
            d = state_diff(a[k], b[k], f"{where}.{k}" if where else str(k))
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = state_diff(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    if a != b and not (isinstance(a, float) and isinstance(b, float) and a != a and b != b):
        return f"{where}: {a!r} vs {b!r}"
    return None


def values_diff(want: dict, got: dict, names: set[str] | None = None, side: int = 0) -> str | None:
    """Differences between two {(name, ctx, rep): (recorded, replayed)} maps, on the
    recorded side (side=0) or got's replayed vs want's recorded (side=1)."""

    def pick(m: dict, s: int) -> dict:
        return {k: v[s] for k, v in m.items() if (names is None or k[0] in names) and v[s] is not None}

    w, g = pick(want, 0), pick(got, side)
    missing = sorted(set(w) - set(g), key=_order)
    extra = sorted(set(g) - set(w), key=_order)
    differ = sorted((k for k in set(w) & set(g) if w[k] != g[k]), key=_order)
    if not (missing or extra or differ):
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (first {_ctx(missing[0])})")
    if extra:
        parts.append(f"{len(extra)} extra (first {_ctx(extra[0])}={g[extra[0]]})")
    if differ:
        k = differ[0]
        parts.append(f"{len(differ)} differ (first {_ctx(k)}: want {w[k]} got {g[k]})")
    return f"{len(w)} values: " + "; ".join(parts)


def _order(key: tuple) -> tuple:
    """Training order: by loop positions first (json's "10" < "9" is not), then name and rep."""
    name, ctx, rep = key
    return (tuple(i for _, i in json.loads(ctx)), name, rep)


def _ctx(key: tuple) -> str:
    name, ctx, rep = key
    c = ",".join(f"{n}={i}" for n, i in json.loads(ctx))
    return f"{name}[{c}{'' if rep == 0 else f',rep={rep}'}]"


# --------------------------------------------------------------------------- the checks
@dataclass
class Reference:
    script: Path
    home: Path
    proc: Proc
    state: Any
    logs: dict[str, Any]
    markers: list[str]


class Zoo:
    def __init__(self, work: Path, seed: int, small: bool, verbose: bool = True) -> None:
        self.work = work
        self.seed = seed
        self.small = small
        self.verbose = verbose
        self._matched: dict[tuple[str, int], Any] = {}

    def say(self, msg: str) -> None:
        if self.verbose:
            print(msg, flush=True)

    def args(self, spec: Spec) -> tuple[str, ...]:
        return spec.small if self.small and spec.small else spec.args

    # -- reference ----------------------------------------------------------------
    def reference(self, name: str) -> Reference | Outcome:
        spec = SCRIPTS[name]
        d = self.work / name / "reference"
        script = prepare(d, spec)
        p = run_script(script, self.args(spec), d / "home", ZOO_OUT=str(d / "final.pt"))
        self.say(f"  [{name}] reference: exit {p.rc} in {p.seconds:.1f} s, {len(p.markers)} steps")
        if p.rc != 0:
            return failure(p, "uninterrupted reference run")
        if not p.markers:
            return Outcome(ERROR, "reference run printed no zoo-step markers")
        logs = logged(d / "home")
        if "error" in logs:
            return Outcome(ERROR, f"reference run: {logs['error']}")
        return Reference(script, d / "home", p, load_state(d / "final.pt"), logs, p.markers)

    # -- resume -------------------------------------------------------------------
    def steps_to_try(self, name: str, ref: Reference, quick: bool) -> list[tuple[str, str, str]]:
        """(label, signal, step tag) of the resume checks."""
        m = ref.markers
        rng = random.Random(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        out = []
        inner = [k for k in range(1, len(m) - 1)]
        for sig in SIGNALS:
            at = m[rng.choice(inner)] if inner else m[0]
            out.append((f"{sig}@random", sig, at))
        first = m[0]
        last = m[-1]
        two_level = ":" in first
        epoch_end = None
        if two_level:
            head = first.split(":")[0]
            epoch_end = [t for t in m if t.split(":")[0] == head][-1]
        for label, at in (("first", first), ("epoch-end", epoch_end), ("last", last)):
            for sig in ("TERM", "KILL"):
                out.append((f"{sig}@{label}", sig, at or ""))
        if quick:
            out = [o for o in out if o[0] in ("TERM@epoch-end", "KILL@random")]
        return out

    def resume(self, name: str, ref: Reference, label: str, sig: str, at: str) -> Outcome:
        spec = SCRIPTS[name]
        if not at:
            return Outcome(SKIP, "no such step in this script (one loop level)")
        d = self.work / name / f"resume-{label.replace('@', '-')}"
        script = prepare(d, spec)
        out = d / "final.pt"
        env = {"ZOO_OUT": str(out), "ZOO_SIGNAL_AT": at, "ZOO_SIGNAL": sig, "ZOO_SIGNAL_FLAG": str(d / "signalled")}
        if sig == "KILL":
            env["HINDSIGHT_SAFETY_MINUTES"] = "0.005"
        t0 = time.perf_counter()
        p = run_script(script, self.args(spec), d / "home", **env)
        attempts = [p]
        keep(d, 0, p)
        want_rc = -signal.SIGKILL if sig == "KILL" else 85
        if not (d / "signalled").exists():
            return Outcome(ERROR, f"step {at} was never reached (exit {p.rc})")
        notes = []
        # A signal in the very last step may find no step boundary left: finishing is fine.
        finished = p.rc == 0 and sig != "KILL" and at == ref.markers[-1]
        if p.rc != want_rc and not finished:
            if p.rc == 0:
                return Outcome(ERROR, f"SIG{sig} at step {at}: the run went on to the end (exit 0, no checkpoint exit)")
            return failure(p, f"SIG{sig} at step {at}")
        if finished:
            notes.append("signalled in the last step, the run finished (exit 0)")
        elif sig != "KILL" and "checkpointed run" not in p.stderr:
            notes.append("no 'checkpointed run' message at exit 85")
        while attempts[-1].rc != 0:
            if len(attempts) > 5:
                return Outcome(ERROR, f"SIG{sig} at step {at}: still not done after {len(attempts)} launches")
            r = run_script(script, self.args(spec), d / "home", **env)
            attempts.append(r)
            keep(d, len(attempts) - 1, r)
            if r.rc == 0:
                break
            if r.rc in (85, -signal.SIGKILL):
                continue
            return failure(r, f"relaunch after SIG{sig} at step {at}")
        last = attempts[-1]
        if len(attempts) > 1 and "resuming run" not in last.stderr:
            notes.append("relaunch did not say 'resuming run'")
        src = re.search(r"continues from (the start|checkpoint \S+)", last.stderr)
        if src:
            notes.append("resumed from " + re.sub(r"checkpoint \d{8}-\d{6}-\w+\.", "", src.group(1)))
        redone = ""
        before = attempts[0].markers
        after = last.markers
        if len(attempts) > 1 and after and before and sig != "KILL" and after[0] in before:
            redone = f"the relaunch's first step marker is {after[0]}, already printed before the signal at {at}"
            notes.append(redone)
        seconds = time.perf_counter() - t0
        problems = []
        if not out.exists():
            return Outcome(ERROR, f"SIG{sig} at step {at}: the completed run wrote no final state", seconds)
        d_state = state_diff(ref.state, load_state(out))
        if d_state:
            problems.append(f"final state: {d_state}")
        logs = logged(d / "home")
        if "error" in logs:
            problems.append(logs["error"])
        else:
            if logs["status"] != "completed":
                problems.append(f"run status {logs['status']}")
            d_logs = values_diff(ref.logs["values"], logs["values"])
            if d_logs:
                problems.append(f"logs: {d_logs}")
        where = f"SIG{sig} at step {at}, {len(attempts)} launches"
        if problems:
            return Outcome(WRONG, f"{where}: " + "; ".join(problems) + " (" + "; ".join(notes) + ")", seconds)
        return Outcome(PASS, where + ("; " + "; ".join(notes) if notes else ""), seconds)

    # -- replay -------------------------------------------------------------------
    def probe_reference(self, name: str, kinds: tuple[str, ...]) -> dict[str, Any] | Outcome:
        spec = SCRIPTS[name]
        d = self.work / name / ("probe-ref-" + "-".join(kinds))
        script = prepare(d, spec, kinds)
        p = run_script(script, self.args(spec), d / "home")
        self.say(f"  [{name}] reference with probes {', '.join(kinds)}: exit {p.rc} in {p.seconds:.1f} s")
        if p.rc != 0:
            return failure(p, f"run with the {'/'.join(kinds)} probe(s) from the start")
        logs = logged(d / "home")
        if "error" in logs:
            return Outcome(ERROR, logs["error"])
        return logs

    def replay(self, name: str, ref: Reference, kind: str, jobs: int, want: dict[str, Any]) -> Outcome:
        spec = SCRIPTS[name]
        d = self.work / name / f"replay-{kind}-j{jobs}"
        script = prepare(d, spec, (kind,))
        shutil.copytree(ref.home, d / "home")
        run_id = ref.logs["run"]
        p = hindsight_cli("replay", script.name, "--run", run_id, "-j", str(jobs), cwd=d, home=d / "home")
        (d / "replay.out").write_text(p.stdout)
        (d / "replay.err").write_text(p.stderr)
        o = self._judge_replay(p, d, ref, kind, jobs, want)
        o.seconds = p.seconds
        o.extra["cpu"] = p.cpu
        return o

    def _judge_replay(self, p: Proc, d: Path, ref: Reference, kind: str, jobs: int, want: dict[str, Any]) -> Outcome:
        summary = " ".join(ln.strip() for ln in p.stdout.splitlines() if "replay" in ln or "restored" in ln)[:300]
        probe = f"zoo_{kind}"
        if p.rc != 0:
            o = failure(p, f"replay -j {jobs}")
            o.seconds = p.seconds
            # A failed replay may still have written values: wrong ones make it WRONG.
            got = logged(d / "home")
            if "values" in got:
                bad = values_diff(want["values"], got["values"], {probe}, side=1)
                wrote = any(v[1] is not None for k, v in got["values"].items() if k[0] == probe)
                if wrote and bad:
                    return Outcome(WRONG, f"{o.detail}; and it wrote wrong values: {bad}", p.seconds)
            return o
        got = logged(d / "home")
        if "error" in got:
            return Outcome(ERROR, f"after replay: {got['error']}", p.seconds)
        problems = []
        bad = values_diff(want["values"], got["values"], {probe}, side=1)
        if bad:
            problems.append(f"{probe}: {bad}")
        # Values recomputed by the replay (the steps a parallel replay runs) must
        # equal the recorded ones; the recorded ones must be left as they were.
        others = {k for k in {k[0] for k in ref.logs["values"]}}
        recomputed = {k: v for k, v in got["values"].items() if k[0] in others and v[1] is not None}
        if recomputed:
            diff = sorted((k for k, v in recomputed.items() if v[0] is not None and v[0] != v[1]), key=_order)
            if diff:
                k = diff[0]
                problems.append(
                    f"replay recomputed {len(diff)} recorded values differently (first {_ctx(k)}: "
                    f"recorded {recomputed[k][0]} replayed {recomputed[k][1]})"
                )
        kept = values_diff(ref.logs["values"], got["values"], others, side=0)
        if kept:
            problems.append(f"recorded values changed: {kept}")
        if "DIVERGENCE" in p.stderr:
            problems.append("replay reported DIVERGENCE: " + excerpt(p.stderr, 2))
        if problems:
            o = Outcome(WRONG, f"-j {jobs}: " + "; ".join(problems) + f" [{summary}]", p.seconds)
            note = re.search(r"each worker uses (\d+) thread\(s\); the recording used (\d+)", p.stderr)
            if note:
                o.detail += f"; replay said: {note.group(0)}"
                o.extra["worker_threads"] = int(note.group(1))
            return o
        n = sum(1 for k in want["values"] if k[0] == probe)
        marks = sorted({f for k, f in got.get("flags", {}).items() if k[0] == probe and f != "exact"})
        note = f", marked {'/'.join(marks)}" if marks else ""
        return Outcome(PASS, f"-j {jobs}: {n} values equal{note} [{summary}]", p.seconds)

    def replay_matched(self, name: str, kind: str, jobs: int, threads: int) -> Outcome:
        """The same replay with the recordings made at the replay workers' thread
        count: PASS there means the WRONG was last-bit noise of another thread count."""
        old = THREADS["n"]
        THREADS["n"] = threads
        try:
            key = (name, threads)
            if key not in self._matched:
                sub = Zoo(self.work / name / f"threads-{threads}", self.seed, self.small, verbose=False)
                self._matched[key] = (sub, sub.reference(name), {})
            sub, ref, wants = self._matched[key]
            if isinstance(ref, Outcome):
                return ref
            if kind not in wants:
                wants[kind] = sub.probe_reference(name, (kind,))
            want = wants[kind]
            if isinstance(want, Outcome):
                return want
            return sub.replay(name, ref, kind, jobs, want)
        finally:
            THREADS["n"] = old

    # -- overhead -----------------------------------------------------------------
    def plain(self, name: str, ref: Reference) -> Outcome:
        spec = SCRIPTS[name]
        d = self.work / name / "plain"
        script = prepare(d, spec)
        shim = shim_dir(self.work)
        pp = os.pathsep.join([str(shim), *filter(None, [os.environ.get("PYTHONPATH")])])
        p = run_script(script, self.args(spec), d / "home", ZOO_OUT=str(d / "final.pt"), PYTHONPATH=pp)
        if p.rc != 0:
            return Outcome(ERROR, f"plain run (no hindsight): exit {p.rc}: {excerpt(p.stderr)}", p.seconds)
        diff = state_diff(load_state(d / "final.pt"), ref.state)
        o = Outcome(
            PASS,
            f"plain {p.seconds:.1f} s ({p.cpu:.1f} s cpu), recorded {ref.proc.seconds:.1f} s ({ref.proc.cpu:.1f} s cpu)",
            p.seconds,
        )
        if diff:
            o = Outcome(WRONG, f"the recorded run's final state differs from the plain script's: {diff}", p.seconds)
        if p.markers != ref.markers:
            o = Outcome(WRONG, f"the plain script ran other steps ({len(p.markers)} vs {len(ref.markers)} recorded)")
        o.extra["plain_s"], o.extra["plain_cpu"] = p.seconds, p.cpu
        return o


# --------------------------------------------------------------------------- the table
COLUMNS = [
    "record",
    "transparent",
    "TERM@random",
    "USR1@random",
    "KILL@random",
    "TERM@first",
    "KILL@first",
    "TERM@epoch-end",
    "KILL@epoch-end",
    "TERM@last",
    "KILL@last",
    "epoch-j1",
    "epoch-j2",
    "step-j1",
    "step-j2",
    "rng-j1",
    "rng-j2",
]


def check_script(
    zoo: Zoo, name: str, checks: set[str], quick: bool, only: set[str] | None = None
) -> dict[str, Outcome]:
    res: dict[str, Outcome] = {}
    spec = SCRIPTS[name]
    zoo.say(f"== {name} ({spec.file}{': ' + spec.note if spec.note else ''})")
    ref = zoo.reference(name)
    if isinstance(ref, Outcome):
        # Nothing can be checked: every applicable check gets the record's status, its reason once.
        res["record"] = Outcome(ref.status, f"the uninterrupted recording: {ref.detail}")
        kinds = probes_of((ZOO / spec.file).read_text())
        for c in COLUMNS[1:]:
            if "-j" in c and c.split("-j")[0] not in kinds:
                continue
            res[c] = Outcome(ref.status, "(the recording failed: see record)")
        return res
    res["record"] = Outcome(PASS, f"{len(ref.markers)} steps in {ref.proc.seconds:.1f} s")
    timing = {"recorded_s": ref.proc.seconds, "recorded_cpu": ref.proc.cpu}
    if "overhead" in checks and (not only or "transparent" in only):
        o = zoo.plain(name, ref)
        res["transparent"] = o
        timing["plain_s"] = o.extra.get("plain_s", 0.0)
        timing["plain_cpu"] = o.extra.get("plain_cpu", 0.0)
        zoo.say(f"  [{name}] transparent: {o.status} {o.detail}")
    if "resume" in checks:
        for label, sig, at in zoo.steps_to_try(name, ref, quick):
            if only and label not in only:
                continue
            o = zoo.resume(name, ref, label, sig, at)
            res[label] = o
            zoo.say(f"  [{name}] {label} (step {at or '-'}): {o.status} {o.detail}")
    if "replay" in checks:
        jobs_list = (1, 2) if not quick else (2,)
        kinds = [
            k
            for k in ("epoch", "step", "rng")
            if k in probes_of((ZOO / spec.file).read_text())
            and (not only or any(f"{k}-j{j}" in only for j in jobs_list))
        ]
        plain_kinds = tuple(k for k in ("epoch", "step") if k in kinds)
        want = zoo.probe_reference(name, plain_kinds) if plain_kinds else None
        for kind in kinds:
            w = want if kind != "rng" else zoo.probe_reference(name, ("rng",))
            for jobs in jobs_list:
                col = f"{kind}-j{jobs}"
                if only and col not in only:
                    continue
                if isinstance(w, Outcome):
                    res[col] = w
                    continue
                assert w is not None
                o = zoo.replay(name, ref, kind, jobs, w)
                if o.status == WRONG and "worker_threads" in o.extra:
                    m = zoo.replay_matched(name, kind, jobs, o.extra["worker_threads"])
                    if m.status == PASS:
                        o.extra["threads_only"] = True
                        o.detail += (
                            f" || recorded at {o.extra['worker_threads']} thread(s) too, the same replay PASSES:"
                            " the difference is the thread count's"
                        )
                    else:
                        o.detail += f" || recorded at {o.extra['worker_threads']} thread(s) too: {m.status}: {m.detail}"
                res[col] = o
                timing[f"replay_{col}_s"] = o.seconds
                timing[f"replay_{col}_cpu"] = o.extra.get("cpu", 0.0)
                zoo.say(f"  [{name}] replay {kind} probe -j {jobs}: {o.status} {o.detail}")
    res["_timing"] = Outcome(PASS, json.dumps(timing), extra=timing)
    return res


def table(results: dict[str, dict[str, Outcome]]) -> str:
    cols = [c for c in COLUMNS if any(c in r for r in results.values())]
    w0 = max([len("script"), *map(len, results)])
    head = ["script".ljust(w0), *(c.ljust(max(len(c), 8)) for c in cols), "record cpu", "replay/record"]
    lines = [" ".join(head)]
    for name, r in results.items():
        cells = [name.ljust(w0)]
        for c in cols:
            o = r.get(c)
            flag = "(t)" if o and o.extra.get("threads_only") else "(d)" if o and o.extra.get("diverged") else ""
            cell = (o.status + flag) if o else SKIP
            cells.append(cell.ljust(max(len(c), 8)))
        t = r.get("_timing")
        # Record CPU against the plain script's; each replay's wall time
        # against the recording's (over 1: slower than training again).
        if t and t.extra.get("plain_cpu"):
            cells.append(f"{t.extra['recorded_cpu'] / t.extra['plain_cpu']:.2f}x".ljust(10))
        else:
            cells.append("-".ljust(10))
        reps = [v for k, v in (t.extra.items() if t else []) if k.startswith("replay_") and k.endswith("_s")]
        rec_s = t.extra.get("recorded_s") if t else None
        cells.append(("/".join(f"{s / rec_s:.2f}" for s in reps)) if reps and rec_s else "-")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def details(results: dict[str, dict[str, Outcome]]) -> str:
    out = []
    for name, r in results.items():
        for c, o in r.items():
            if c.startswith("_") or o.status in (PASS, SKIP) or o.detail.startswith("(the recording failed"):
                continue
            out.append(f"{o.status:8} {name} / {c}: {o.detail}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scripts", nargs="*", help=f"names among {', '.join(SCRIPTS)}")
    ap.add_argument("--all", action="store_true", help="every script")
    ap.add_argument("--checks", default="overhead,resume,replay", help="comma-separated: overhead,resume,replay")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("ZOO_SEED", "0")), help="picks the random steps")
    ap.add_argument("--small", action="store_true", help="the smaller CI-size runs")
    ap.add_argument("--quick", action="store_true", help="two resume checks and -j 2 replays only")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    ap.add_argument("--only", default="", help="comma-separated columns, e.g. TERM@last,step-j2")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the script runs (0: inherit)")
    a = ap.parse_args(argv)
    THREADS["n"] = a.threads
    names = list(SCRIPTS) if a.all or not a.scripts else a.scripts
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        ap.error(f"unknown script(s) {unknown}; known: {', '.join(SCRIPTS)}")
    checks = set(a.checks.split(","))
    work = a.workdir or Path(tempfile.mkdtemp(prefix="hindsight-zoo-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"zoo: work directory {work}, seed {a.seed} (random steps: --seed {a.seed} repeats them)", flush=True)
    zoo = Zoo(work, a.seed, a.small)
    results: dict[str, dict[str, Outcome]] = {}
    t0 = time.perf_counter()
    try:
        for name in names:
            results[name] = check_script(zoo, name, checks, a.quick, set(filter(None, a.only.split(","))))
    finally:
        print()
        print(table(results))
        print()
        print(details(results) or "every check passed")
        print(f"\nzoo: {time.perf_counter() - t0:.0f} s")
        if a.json:
            a.json.write_text(
                json.dumps(
                    {
                        n: {c: {"status": o.status, "detail": o.detail, **o.extra} for c, o in r.items()}
                        for n, r in results.items()
                    },
                    indent=1,
                )
            )
        if not a.keep and a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
        elif a.keep:
            print(f"zoo: kept {work}")
    bad = [(n, c) for n, r in results.items() for c, o in r.items() if o.status in (WRONG, ERROR)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

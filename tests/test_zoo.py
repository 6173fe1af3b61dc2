"""The zoo's bounded subset, part of CI: every public training script of tests/zoo/ once, with one
signal at a boundary step (SIGTERM, SIGUSR1 and kill -9 rotated over the
scripts) and one probe replay (-j 2 for about half of them), at the scripts'
smaller CI size. `make zoo` (tests/zoo/driver.py --all) runs the full matrix.

A check passes when hindsight's result is bit-identical to the reference run,
or when hindsight refuses with the reason listed in EXPECTED_REFUSALS; a WRONG
(values or final state differ, values missing) or an ERROR (a crash that is no
hindsight refusal) fails the test with the driver's details.

Every script runs with one torch thread (the driver's default: tiny models
on shared cores); replay gives its workers the recording's thread count.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "zoo"))

import driver  # tests/zoo/driver.py

# script: (signal, boundary step, probe kind, replay -j)
CASES: dict[str, tuple[str, str, str, int]] = {
    "mnist": ("TERM", "first", "step", 2),
    "word_language_model": ("USR1", "last", "step", 2),
    "dcgan": ("KILL", "epoch-end", "step", 1),
    "vae": ("TERM", "epoch-end", "epoch", 1),
    "time_sequence_prediction": ("TERM", "last", "step", 2),
    "siamese_network": ("USR1", "epoch-end", "epoch", 2),
    "imagenet": ("KILL", "epoch-end", "step", 1),
    "reinforce": ("USR1", "first", "epoch", 2),
    "nanogpt": ("KILL", "last", "step", 2),
    "timm_train": ("USR1", "first", "step", 1),
    "iterable_dataset": ("TERM", "epoch-end", "step", 2),
    "mingpt_trainer": ("KILL", "last", "epoch", 1),
    "accelerate_nlp": ("TERM", "epoch-end", "step", 2),
    "hf_trainer": ("TERM", "epoch-end", "step", 2),
}

# (script, "resume" | "replay"): a text the refusal must contain. A REFUSED
# not listed here fails, as does a listed one that stops being refused
# (then the entry goes).
EXPECTED_REFUSALS: dict[tuple[str, str], str] = {}

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def judge(script: str, check: str, o: driver.Outcome) -> None:
    expected = EXPECTED_REFUSALS.get((script, check))
    if o.status == driver.REFUSED and expected is not None:
        assert expected in o.detail, f"refused for another reason than {expected!r}: {o.detail}"
        return
    if expected is not None:
        pytest.fail(f"{check} of {script} was expected to be refused ({expected!r}) but is {o.status}: {o.detail}")
    assert o.status == driver.PASS, f"{script} {check}: {o.status}: {o.detail}"


def boundary(markers: list[str], which: str) -> str:
    if which == "first":
        return markers[0]
    if which == "last":
        return markers[-1]
    head = markers[0].split(":")[0]
    if ":" not in markers[0]:
        return markers[len(markers) // 2]  # one loop level: a step in the middle
    return [t for t in markers if t.split(":")[0] == head][-1]


@pytest.mark.parametrize("script", list(CASES))
def test_zoo_script_resumes_and_replays_exactly(script: str, tmp_path: Path) -> None:
    sig, which, kind, jobs = CASES[script]
    driver.THREADS["n"] = 1
    zoo = driver.Zoo(tmp_path, seed=0, small=True, verbose=False)
    ref = zoo.reference(script)
    if isinstance(ref, driver.Outcome):
        judge(script, "resume", ref)
        judge(script, "replay", ref)
        return
    at = boundary(ref.markers, which)
    resumed = zoo.resume(script, ref, f"{sig}@{which}", sig, at)
    want = zoo.probe_reference(script, (kind,))
    replayed = want if isinstance(want, driver.Outcome) else zoo.replay(script, ref, kind, jobs, want)
    failures = []
    for check, o in (("resume", resumed), ("replay", replayed)):
        try:
            judge(script, check, o)
        except (AssertionError, pytest.fail.Exception) as e:
            failures.append(f"{check} (SIG{sig} at {at} / {kind} probe -j {jobs}): {e}")
    assert not failures, "\n".join(failures)

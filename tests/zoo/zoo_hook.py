"""The zoo's test hook: the one thing each zoo script calls that its original
does not (besides hindsight itself), so that `driver.py` can see where a run
is and stop it at an exact step.

`step(*where)` is called once per training step (at its end: after the
optimizer step and the step's `hs.log` calls). It prints `zoo-step a:b` and,
when `$ZOO_SIGNAL_AT` names this step, sends the process `$ZOO_SIGNAL`
(TERM, USR1, INT or KILL) itself (only rank `$ZOO_SIGNAL_RANK` when set;
`$ZOO_SIGNAL_TO=group`: the whole process group, `launcher`: the parent
process, torchrun's agent), once: `$ZOO_SIGNAL_FLAG` is created first, so a
relaunch that recomputes the same step (after a kill -9) goes on.

`final(**state)` saves the final state (tensors, state_dicts) to `$ZOO_OUT`
when set, for the driver to compare bit for bit.

During replay and in the plain (no hindsight) timing none of these variables
is set: the hook only prints.
"""

from __future__ import annotations

import os
import signal

_SIGNALS = {"TERM": signal.SIGTERM, "USR1": signal.SIGUSR1, "INT": signal.SIGINT, "KILL": signal.SIGKILL}


def step(*where: object) -> None:
    tag = ":".join(str(int(w)) for w in where)  # type: ignore[call-overload]
    print(f"zoo-step {tag}", flush=True)
    _signal_at(tag)


def point(*where: object) -> None:
    """A place that is not a step (an evaluation): the signal may be asked
    for there too (`$ZOO_SIGNAL_AT=5:eval`), and no step is marked."""
    _signal_at(":".join(str(w) for w in where))


def _signal_at(tag: str) -> None:
    if os.environ.get("ZOO_SIGNAL_AT") != tag:
        return
    rank = os.environ.get("ZOO_SIGNAL_RANK")
    if rank is not None and rank != os.environ.get("RANK", "0"):
        return
    flag = os.environ.get("ZOO_SIGNAL_FLAG", "")
    if flag and os.path.exists(flag):
        return
    if flag:
        with open(flag, "w") as f:
            f.write(tag)
    sig = _SIGNALS[os.environ.get("ZOO_SIGNAL", "TERM")]
    to = os.environ.get("ZOO_SIGNAL_TO", "self")
    if to == "group":
        os.killpg(0, sig)  # the whole job, as a batch system's eviction sends it
    elif to == "launcher":
        os.kill(os.getppid(), sig)  # torchrun's agent alone (docker stop, Kubernetes)
    else:
        os.kill(os.getpid(), sig)


def final(**state: object) -> None:
    out = os.environ.get("ZOO_OUT")
    if not out:
        return
    import torch

    def plain(v: object) -> object:
        if hasattr(v, "state_dict") and not isinstance(v, torch.Tensor):
            v = v.state_dict()  # type: ignore[attr-defined]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        return v

    if "RANK" in os.environ:  # under torchrun: each rank its own file
        out = f"{out}.rank{os.environ['RANK']}"
    tmp = out + ".tmp"
    torch.save(plain(state), tmp)
    os.replace(tmp, out)

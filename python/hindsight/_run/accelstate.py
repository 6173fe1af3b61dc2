"""accelerate's loop state (the step, gradient sync, each prepared
DataLoader's position and sampler epoch) as a state_dict/load_state_dict
pair: kept by `hindsight.accelerate` and, for an Accelerator a loop holds in
a variable, by `objstate`. Apart from `hindsight.accelerate` so that the
recording's modules can use it without importing the front end that uses them."""

from __future__ import annotations

from typing import Any

from hindsight._run import dataiter
from hindsight.errors import ReplayError


def _sampler(dl: Any) -> Any:
    """The sampler of a prepared DataLoader that keeps an epoch (accelerate's
    SeedableRandomSampler, a DistributedSampler), or None."""
    for owner in (
        getattr(dl, "batch_sampler", None),
        getattr(getattr(dl, "batch_sampler", None), "batch_sampler", None),
    ):
        s = getattr(owner, "sampler", None)
        if s is not None and isinstance(getattr(s, "epoch", None), int) and callable(getattr(s, "set_epoch", None)):
            return s
    s = getattr(dl, "sampler", None)
    if s is not None and isinstance(getattr(s, "epoch", None), int) and callable(getattr(s, "set_epoch", None)):
        return s
    return None


def _generators(dl: Any) -> list[Any]:
    """The torch generators a prepared DataLoader draws its order from
    besides the global one: its own, its sampler's, accelerate's synchronised one."""
    import torch

    found = {id(g): g for g in dataiter._generators(dl)}
    g = getattr(dl, "synchronized_generator", None)
    if isinstance(g, torch.Generator):
        found.setdefault(id(g), g)
    return list(found.values())


class LoopState:
    """What accelerate keeps outside the prepared objects' own state dicts,
    as a state_dict/load_state_dict pair hindsight checkpoints.

    ``generators``: also the states of the prepared DataLoaders' generators
    (`save_state`; in a recording the run keeps them with its RNG states)."""

    def __init__(self, accelerator: Any, generators: bool = False) -> None:
        self.accelerator = accelerator
        self.generators = generators

    def state_dict(self) -> dict[str, Any]:
        acc = self.accelerator
        loaders = []
        for dl in acc._dataloaders:
            sampler = _sampler(dl)
            entry: dict[str, Any] = {
                "iteration": int(getattr(dl, "iteration", 0)),
                "sampler_epoch": None if sampler is None else int(sampler.epoch),
            }
            if self.generators:
                entry["generators"] = [g.get_state() for g in _generators(dl)]
            loaders.append(entry)
        return {
            "step": int(acc.step),
            "sync_gradients": bool(acc.gradient_state.sync_gradients),
            "save_iteration": int(getattr(acc.project_configuration, "iteration", 0)),
            "loaders": loaders,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        acc = self.accelerator
        loaders = list(acc._dataloaders)
        if len(state["loaders"]) != len(loaders):
            raise ReplayError(
                f"the checkpoint holds accelerate's state of {len(state['loaders'])} prepared DataLoaders; "
                f"this program prepared {len(loaders)} (prepare the same loaders, in the same order, "
                "before the training loop)"
            )
        acc.step = int(state["step"])
        # Read by the prepared optimizer and scheduler before the next
        # accumulate() sets it again (and by `if accelerator.sync_gradients:`).
        acc.gradient_state._set_sync_gradients(bool(state["sync_gradients"]))
        acc.project_configuration.iteration = int(state["save_iteration"])
        for dl, saved in zip(loaders, state["loaders"], strict=True):
            if hasattr(dl, "iteration"):
                dl.iteration = int(saved["iteration"])
            sampler = _sampler(dl)
            if sampler is not None and saved["sampler_epoch"] is not None:
                sampler.set_epoch(int(saved["sampler_epoch"]))
            gens = saved.get("generators")
            if gens is not None:
                live = _generators(dl)
                if len(live) != len(gens):
                    raise ReplayError(
                        f"the checkpoint holds {len(gens)} generators of a prepared DataLoader; "
                        f"this program's draws from {len(live)}"
                    )
                for g, st in zip(live, gens, strict=True):
                    g.set_state(st)

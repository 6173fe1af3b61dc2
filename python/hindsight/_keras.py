"""The Keras 3 callback of `hindsight.keras`, in a module of its own because
defining it imports keras. It translates ``model.fit``'s hooks into the
recorder's events (`_fit.FitRecorder`) and packs and restores Keras's state;
it decides nothing about saves, resumes or replays."""

from __future__ import annotations

import os
import time
from typing import Any

import keras
import torch

from hindsight import _fit, session
from hindsight._run import batches
from hindsight._store import Store
from hindsight.errors import CorruptError, InvalidArgumentError, ReplayError

DEFAULT_PREFIX = "keras"
_GROUPS = ("model", "optimizer", "metrics")


def _variables(model: Any, group: str) -> list[Any]:
    if group == "model":
        return list(model.variables)  # weights, non-trainable state, dropout seed states
    if group == "optimizer":
        return list(model.optimizer.variables) if model.optimizer is not None else []
    return list(model.metrics_variables)  # the epoch's running loss and metrics


def _pack(model: Any) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for group in _GROUPS:
        entries: dict[str, torch.Tensor] = {}
        for v in _variables(model, group):
            if v.path in entries:
                raise InvalidArgumentError(
                    f"keras.HindsightCallback: two {group} variables share the path {v.path!r}: "
                    "name the layers so that a restore can tell them apart"
                )
            entries[v.path] = torch.as_tensor(keras.ops.convert_to_numpy(v.value)).clone()
        out[group] = entries
    return out


def _restore(model: Any, state: Any, name: str) -> None:
    """Assign every variable its checkpointed value, or stop naming the first
    one missing, extra or of another shape (nothing half-restored is trained)."""
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    plan: list[tuple[Any, torch.Tensor]] = []
    for group in _GROUPS:
        saved = state.get(group) if isinstance(state, dict) else None
        if not isinstance(saved, dict):
            raise CorruptError(
                f"checkpoint {name}: no {group!r} variables (was it written by keras.HindsightCallback?)"
            )
        live = {v.path: v for v in _variables(model, group)}
        if set(live) != set(saved):
            missing = sorted(set(live) - set(saved))[:3]
            extra = sorted(set(saved) - set(live))[:3]
            raise InvalidArgumentError(
                f"checkpoint {name} does not fit this model's {group} variables: "
                f"not in the checkpoint {missing}, not in the model {extra}"
            )
        for path, v in live.items():
            t = saved[path]
            if tuple(t.shape) != tuple(v.shape):
                raise InvalidArgumentError(
                    f"checkpoint {name}: {group} variable {path!r} has shape {tuple(t.shape)}, the model's {tuple(v.shape)}"
                )
            plan.append((v, t))
    for v, t in plan:
        v.assign(t.numpy())


class HindsightCallback(keras.callbacks.Callback):  # type: ignore[misc]  # keras ships no types
    """Record ``model.fit`` in the script's hindsight run, checkpoint it into
    a hindsight store, stop cleanly on preemption signals and resume exactly
    (the epoch, the step inside it, the optimizer and the running metrics).
    See ``help(hindsight.keras)``."""

    def __init__(
        self,
        store: Store | str | os.PathLike[str] | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        every_n_epochs: int | None = 1,
        every_n_train_steps: int | None = None,
        keep_last: int | None = None,
        keep_best: int | None = None,
        monitor: str | None = None,
        mode: str = "min",
        keep_every: int | None = None,
        exit_code: int | None = None,
        requeue: bool | None = None,
        catch_sigint: bool = False,
    ) -> None:
        super().__init__()
        self.rec = _fit.FitRecorder(
            "keras.HindsightCallback",
            store,
            prefix=prefix,
            every_n_epochs=every_n_epochs,
            every_n_train_steps=every_n_train_steps,
            keep_last=keep_last,
            keep_best=keep_best,
            monitor=monitor,
            mode=mode,
            keep_every=keep_every,
            exit_code=exit_code,
            requeue=requeue,
            catch_sigint=catch_sigint,
        )
        self._epoch = 0
        self._step = 0  # batches trained in this epoch
        self._global = 0  # batches trained in the fit
        self._epoch_rng: torch.Tensor | None = None
        # A resume into the middle of an epoch: its epoch, batches to skip,
        # and the state to put back after the last skipped one.
        self._resume: dict[str, Any] | None = None
        # model.fit's own train step, wrapped for the fit (`_train_step`);
        # the fingerprints of the batches this epoch trained so far.
        self._inner: Any = None
        self._prints: list[str] = []
        self._start: _fit.ReplayStart | None = None
        self._stopped = False
        self._last_epoch = 0

    @property
    def store(self) -> Store:
        return self.rec.store

    @property
    def last_saved(self) -> str | None:
        return self.rec.last_saved

    def latest(self) -> str | None:
        """Name of the checkpoint the next ``fit`` resumes from, or None."""
        return self.rec.latest()

    # -- fit begins -----------------------------------------------------------------
    def _check_fit(self) -> None:
        if keras.backend.backend() != "torch":
            raise InvalidArgumentError(
                f"keras.HindsightCallback needs Keras's torch backend (KERAS_BACKEND=torch), not {keras.backend.backend()!r}"
            )
        if int(getattr(self.model, "steps_per_execution", 1) or 1) != 1:
            raise InvalidArgumentError(
                "keras.HindsightCallback: compile(steps_per_execution>1) runs several batches per call, "
                "so no checkpoint can fall between them; use steps_per_execution=1"
            )

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._check_fit()
        self._epoch = self._step = self._global = 0
        self._resume = None
        self._stopped = False
        # Keras looks the step up at every batch: ours fingerprints it, and
        # moves past the batches a resume skips without training them.
        self._inner, self.model.train_function = self.model.train_function, self._train_step
        if session.replaying("epoch") is not None or self.rec.replay is not None:
            self._replay_begin()
            return
        self.rec.claim_run("fit()")
        name = self.rec.latest()
        if name is not None:
            self._resume_from(name)
        self.rec.begin(name, self._global, self.params.get("epochs"))

    def _resume_from(self, name: str) -> None:
        state = self.store.load(name)
        if state.get("finished"):
            return
        _restore(self.model, state.get("keras"), name)
        epoch, step = int(state["epoch"]), int(state["step"])
        self._global = int(state["global_step"])
        rng = state["rng"]
        # model.fit starts its loop at this epoch (Keras's own hook for it).
        self.model._initial_epoch = epoch
        self._resume = {
            "epoch": epoch,
            "skip": step,
            "rng": rng["now"],
            "epoch_rng": rng["epoch"],
            "metrics": state["keras"]["metrics"],
            "prints": list(state.get("prints") or []),
            "name": name,
        }
        where = f"epoch {epoch}" + (f", after {step} of its batches" if step else "")
        print(f"hindsight: resuming Keras fit from {name} ({where})", flush=True)

    # -- epochs and batches --------------------------------------------------------------
    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.model._initial_epoch = None  # read once, by this fit: never by the model's next fit
        r = self._resume
        if r is not None:
            if epoch != r["epoch"]:
                raise InvalidArgumentError(
                    f"keras.HindsightCallback: fit starts at epoch {epoch}, but checkpoint {r['name']} resumes "
                    f"epoch {r['epoch']} (fit(initial_epoch=...) or another callback moved the start)"
                )
            if r["skip"]:
                # The epoch's order is drawn from the RNG as its iterator starts.
                torch.set_rng_state(r["epoch_rng"])
            else:
                torch.set_rng_state(r["rng"])
                self._resume = None
        self._epoch, self._step = epoch, 0
        self._prints = []
        self._epoch_rng = torch.get_rng_state()
        session.context([("epoch", epoch)])
        if self.rec.replay is not None:
            self.rec.replay_epoch_begin(epoch, self._start)
            self._start = None
        else:
            self.rec.epoch_begin(epoch)

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        r = self._resume
        if r is not None and batch < r["skip"]:
            return  # trained before the checkpoint: `_train_step` moves past it
        session.context([("epoch", self._epoch), ("step", self._global + 1)])

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        r = self._resume
        if r is not None and batch < r["skip"]:
            if batch + 1 < r["skip"]:
                return
            # The last skipped batch: the state of the checkpoint from here on.
            for v in self.model.metrics_variables:
                v.assign(r["metrics"][v.path].numpy())
            torch.set_rng_state(r["rng"])
            self._step, self._resume = r["skip"], None
            return
        self._step += 1
        self._global += 1
        if self.rec.replay is not None:
            self.rec.replay.session.step(self._epoch, self._global, "")
            return
        if self.params.get("steps") is not None and self._step >= int(self.params["steps"]):
            return  # the epoch's last batch: its end decides
        order = self.rec.step_end(self._epoch, self._global)
        if order is not None:
            self.rec.save(order, self._tree(), self._meta("step"))

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        session.context([("epoch", epoch)])
        self.rec.log([("epoch", epoch)], dict(logs or {}))
        if self.rec.replay is not None:
            check, last = self.rec.replay_epoch_end(epoch)
            if check is not None:
                self._check_state(epoch, check)
            self.rec.replay_progress(epoch)
            if last and not self.model.stop_training:
                self.model.stop_training = True
                self._stopped = True
            return
        order = self.rec.epoch_end(epoch)
        self._step, self._last_epoch, self._prints = 0, epoch, []
        self._epoch = epoch + 1  # a checkpoint here resumes at the next epoch's start
        self.rec.epoch_done(epoch, None if order is None else order.name)
        if order is not None:
            self.rec.save(order, self._tree(), self._meta("epoch"))
        self.rec.leave_if_pending()

    def _train_step(self, data: Any) -> Any:
        """model.fit's train step, fingerprinting its batch. A batch a resume
        skips is not trained, but must be the batch the recording trained
        there: a data order the restored RNG states do not reproduce (a
        PyDataset that reshuffles in on_epoch_end, a generator) stops the
        fit before it trains anything, naming the batch."""
        printed = batches.digest(data)
        r = self._resume
        if r is not None and len(self._prints) < r["skip"]:
            i = len(self._prints)
            want = r["prints"][i] if i < len(r["prints"]) else None
            if want is not None and printed != want:
                raise ReplayError(
                    f"keras.HindsightCallback: resuming from {r['name']}, batch {i} of epoch {self._epoch} is not "
                    "the batch the interrupted fit trained there: the data's order is not reproduced by the RNG "
                    "states hindsight restores (a PyDataset that shuffles in on_epoch_end, a generator, a "
                    "DataLoader with a generator of its own); nothing was trained. Draw the order from torch's "
                    "RNG (fit(shuffle=True) on arrays or tensors), or set every_n_train_steps=None so that "
                    "checkpoints fall at epoch ends"
                )
            self._prints.append(printed)
            return {}
        self._prints.append(printed)
        return self._inner(data)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self.model.train_function == self._train_step:
            self.model.train_function = self._inner
        if self.rec.replay is not None:
            self.rec.replay_end(self._stopped)
            return
        self.rec.finish(self._last_epoch, {"epoch": self._epoch, "global_step": self._global}, self._meta("fit_end"))

    # -- state -------------------------------------------------------------------------
    def _tree(self) -> dict[str, Any]:
        assert self._epoch_rng is not None
        return {
            "keras": _pack(self.model),
            "epoch": self._epoch,
            "step": self._step,
            "global_step": self._global,
            "rng": {"epoch": self._epoch_rng, "now": torch.get_rng_state()},
            # The epoch's batches so far: a resume checks the ones it skips.
            "prints": list(self._prints),
        }

    def _meta(self, kind: str) -> dict[str, object]:
        return {"keras": keras.__version__, "epoch": self._epoch, "global_step": self._global, "kind": kind}

    # -- replay -----------------------------------------------------------------------------
    def _replay_begin(self) -> None:
        start = self.rec.replay_start()
        self._start = start
        if start.checkpoint is None:
            return
        t0 = time.perf_counter()
        state = self.store.load(start.checkpoint)
        _restore(self.model, state.get("keras"), start.checkpoint)
        # The plan restores epoch `start.epoch` (its end): the fit executes from the next one.
        if int(state["epoch"]) != start.epoch + 1 or int(state["step"]) != 0:
            raise CorruptError(
                f"checkpoint {start.checkpoint} holds epoch {state['epoch']} step {state['step']}, "
                f"not the end of epoch {start.epoch}"
            )
        self._global = int(state["global_step"])
        self.model._initial_epoch = start.epoch + 1
        self._resume = {"epoch": start.epoch + 1, "skip": 0, "rng": state["rng"]["now"], "name": start.checkpoint}
        self.rec.replay_restored(start, time.perf_counter() - t0)

    def _check_state(self, epoch: int, name: str) -> None:
        """Stop unless the weights this worker trained are the checkpoint's."""
        saved = self.store.load(name)["keras"]["model"]
        for v in self.model.variables:
            want = saved.get(v.path)
            if want is None:
                continue
            have = torch.as_tensor(keras.ops.convert_to_numpy(v.value))
            if not torch.equal(have, want):
                self.rec.replay_differs(epoch, name, f"model/{v.path}", "the weights differ")
                return

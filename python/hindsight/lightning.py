"""PyTorch Lightning integration: hindsight checkpoints, preemption and
retention for ``Trainer.fit``.

    import hindsight as hs
    from hindsight.lightning import HindsightCheckpoint

    store = hs.Store("ckpts")
    cb = HindsightCheckpoint(store, keep_last=2)
    trainer = L.Trainer(max_epochs=10, callbacks=[cb])
    trainer.fit(model, datamodule=dm, ckpt_path=HindsightCheckpoint.latest_path(store))
    # first run: latest_path is None, training starts afresh; after a
    # preemption (exit status 85) the same command resumes where it stopped.

What the callback does:

* Saves the trainer's full checkpoint (the dict Lightning's own
  ``ModelCheckpoint`` writes: model ``state_dict``, optimizer and LR scheduler
  states, loop progress incl. mid-epoch position, callback states,
  hyper-parameters, precision plugin state), plus the Python / NumPy / torch /
  CUDA RNG states, into a :class:`hindsight.Store` at the end of every
  ``every_n_epochs``-th training epoch and, if set, every
  ``every_n_train_steps`` optimizer steps. ``store.save`` returns once the
  changed bytes are copied; hashing and writing happen in the background.
  Names: ``<prefix>.epoch-000003`` (end of epoch 3, 0-based as
  ``trainer.current_epoch``) and ``<prefix>.epoch-000003.step-000000420``
  (mid-epoch, after global step 420).
* Preemption: SIGTERM and SIGUSR1 (SIGINT with ``catch_sigint=True``) only set
  a flag. At the next optimizer-step boundary (``on_train_batch_end``) or at
  the epoch end, it writes a checkpoint, waits until it is durable, and
  exits with the checkpoint exit code: ``exit_code=...``, else HTCondor's
  ``CheckpointExitCode`` from ``$_CONDOR_JOB_AD``, else
  ``$HINDSIGHT_EXIT_CODE``, else 85 (``sys.exit``: Lightning's ``on_exception``
  hooks and teardown run on the way out). ``requeue=True`` (or
  ``$HINDSIGHT_SLURM_REQUEUE=1``) runs ``scontrol requeue $SLURM_JOB_ID``
  first. During ``fit`` the callback replaces Lightning's own SIGTERM handler
  (which stops training with exit status 0 and no checkpoint) and, being
  installed first, keeps Lightning's Slurm SIGUSR1 auto-requeue handler (an
  ``hpc_ckpt_*.ckpt`` ``torch.save`` plus requeue) from being installed; pass
  ``plugins=[SLURMEnvironment(auto_requeue=False)]`` on Slurm anyway so that
  ``fit(ckpt_path=None)`` never picks up an old ``hpc_ckpt`` file.
* Resume: ``trainer.fit(model, ckpt_path="hindsight://<name>")``. The callback
  wraps the strategy's ``CheckpointIO`` (in its ``setup`` hook, before
  Lightning restores) with :class:`HindsightCheckpointIO`, which reads
  ``hindsight://`` paths from the store and passes every other path to the
  wrapped IO unchanged. ``HindsightCheckpoint.latest_path(store)`` names the
  newest checkpoint (None when there is none). Lightning restores the model,
  optimizers, schedulers, callbacks and the fit loop (epoch, global step,
  batch position); the callback restores the RNG states (``restore_rng``).
* Retention (a union; the newest checkpoint is always kept):
  ``keep_last=N`` epoch-end checkpoints, ``keep_best=K`` by ``monitor``
  (a key of ``trainer.callback_metrics`` at epoch end, ``mode`` "min" or
  "max"; the value is stored in the checkpoint's metadata so it survives
  restarts; metrics logged in training/validation steps qualify, ones logged
  in ``LightningModule.on_train_epoch_end`` do not, as that hook runs after
  the callback's), ``keep_every=N`` (epochs that are multiples of N). Mid-epoch
  checkpoints are dropped once an epoch-end checkpoint of the same or a later
  epoch exists; of the newer ones the ``keep_last`` newest (at least one)
  stay. Without any ``keep_*`` nothing is removed. Removal is durable at
  once; ``gc`` reclaims the chunks when ``fit`` ends.

Non-tensor values: everything Lightning itself puts in the dict (ints,
floats, strings, nested dicts/lists/tuples, ``None``) is stored natively, so
loading never runs code. Only user-provided extras can fall outside that,
typically hyper-parameters (``save_hyperparameters`` of a ``Path``, an
``Enum``, a ``Namespace``, an OmegaConf container) or values added in
``on_save_checkpoint``. Those are refused with an ``UnsupportedTypeError``
naming the key; hyper-parameters are checked when ``fit`` starts, not after
the first epoch. ``allow_pickle=True`` (on the callback; it is passed to the
``CheckpointIO`` it installs) pickles such values and lets loading unpickle
them: use it only for a store you trust.

Limitations:

* Mid-epoch resume restores Lightning's loop position, but the data order is
  Lightning's business: with a plain ``DataLoader`` the rest of the epoch is
  drawn from a fresh iterator (Lightning warns "your dataloader is not
  resumable"), so the samples seen differ from an uninterrupted run. A
  loader with ``state_dict``/``load_state_dict`` (torchdata's
  ``StatefulDataLoader``) has its state saved and restored by Lightning (how
  exactly it resumes is up to Lightning and the loader; not tested here).
  Epoch-end resume is exact on CPU (tested: bit-identical weights with
  shuffling and dropout, thanks to the restored RNG states).
* A signal during validation or a long epoch-end hook is acted on after it.
* With ``accumulate_grad_batches > 1`` the signal checkpoint waits for the
  next optimizer step (accumulated gradients are not part of a checkpoint).
* Strategies: single device and DDP (rank 0 writes; the stop decision is
  all-reduced so every rank stops at the same step; checked by hand with 2
  CPU ranks on gloo, not covered by the tests). Sharded strategies that bypass ``CheckpointIO`` or shard the state
  dict (DeepSpeed, FSDP sharded state) are not supported.
* ``lightning.pytorch`` is used when installed, else ``pytorch_lightning``;
  when both are, the one already imported wins, and
  ``$HINDSIGHT_LIGHTNING=pytorch_lightning`` forces a choice (a callback of
  one package is rejected by the other's ``Trainer``).
"""

from __future__ import annotations

import collections
import importlib
import os
import re
import signal
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

from hindsight import _native, _preemption
from hindsight._store import Store
from hindsight.errors import InvalidArgumentError, NotFoundError, UnsupportedTypeError

SCHEME = "hindsight://"
DEFAULT_PREFIX = "lightning"
# Extra key holding the model state_dict's `_metadata` (module versions), which
# torch.save keeps as an attribute of the OrderedDict and a plain dict loses.
_METADATA_KEY = "hindsight_state_dict_metadata"
_PATH_RE = re.compile(r"^hindsight:/{1,2}(?P<name>[^/]+)$")

__all__ = [
    "SCHEME",
    "Entry",
    "HindsightCheckpoint",  # noqa: F822 - built on first access (module __getattr__)
    "HindsightCheckpointIO",  # noqa: F822 - built on first access (module __getattr__)
    "checkpoints",
    "latest",
    "latest_path",
    "load",
]


# -- which Lightning -------------------------------------------------------------
_PL: Any = None
_CLASSES: dict[str, type] = {}


def _import_lightning() -> Any:
    """`lightning.pytorch` (or `pytorch_lightning`), imported on first use."""
    global _PL
    if _PL is not None:
        return _PL
    forced = os.environ.get("HINDSIGHT_LIGHTNING")
    if forced:
        candidates = [{"lightning": "lightning.pytorch"}.get(forced, forced)]
    else:
        candidates = ["lightning.pytorch", "pytorch_lightning"]
        loaded = [c for c in candidates if c in sys.modules]
        if len(loaded) == 1:  # the user's script already chose one
            candidates = loaded + [c for c in candidates if c not in loaded]
    errors = []
    for mod in candidates:
        try:
            _PL = importlib.import_module(mod)
            return _PL
        except ImportError as e:
            errors.append(f"{mod}: {e}")
    raise ImportError(
        "hindsight.lightning needs PyTorch Lightning: `pip install lightning` (or `pip install "
        f"pytorch-lightning`); could not import {' / '.join(candidates)} ({'; '.join(errors)})"
    )


def __getattr__(name: str) -> Any:
    if name in ("HindsightCheckpoint", "HindsightCheckpointIO"):
        if not _CLASSES:
            _build()
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- names, listing, resume ---------------------------------------------------------------
class Entry(NamedTuple):
    """A checkpoint written by the callback."""

    name: str
    epoch: int
    end: bool  # taken at the end of the epoch (else mid-epoch)
    step: int  # global step of a mid-epoch checkpoint; -1 at epoch end

    @property
    def order(self) -> tuple[int, int, int]:
        return (self.epoch, 1 if self.end else 0, self.step)


def _check_prefix(prefix: str) -> str:
    try:
        _native.CheckpointId(prefix, "epoch", 0)
    except (InvalidArgumentError, TypeError):
        raise InvalidArgumentError(
            f"prefix {prefix!r}: use 1-150 characters from A-Z a-z 0-9 . _ - = + @ , not starting with '.'"
        ) from None
    return prefix


def _open(store: Store | str | os.PathLike[str]) -> tuple[Store | None, bool]:
    """(store, opened here). A path to a store that does not exist yet gives None."""
    if isinstance(store, Store):
        return store, False
    try:
        return Store(store, create=False), True
    except NotFoundError:
        return None, False


def _entries(store: Store, prefix: str) -> list[Entry]:
    return [
        Entry(ck.name, ck.index, ck.kind != "step", -1 if ck.step is None else ck.step)
        for ck in store.checkpoints(prefix)
        if ck.loop_name == "epoch"
    ]


def checkpoints(store: Store | str | os.PathLike[str], prefix: str = DEFAULT_PREFIX) -> list[Entry]:
    """The callback's complete checkpoints in ``store``, oldest first."""
    _check_prefix(prefix)
    s, owned = _open(store)
    if s is None:
        return []
    try:
        return _entries(s, prefix)
    finally:
        if owned:
            s.close()


def latest(store: Store | str | os.PathLike[str], prefix: str = DEFAULT_PREFIX, *, verify: bool = False) -> str | None:
    """Name of the newest complete checkpoint (epoch-end or mid-epoch), or None.

    With ``verify=True`` every byte of the candidate is read and checked first,
    and a damaged checkpoint is skipped (with a warning) for the one before it;
    without it a damaged checkpoint is reported by the load, never returned wrong.
    """
    _check_prefix(prefix)
    s, owned = _open(store)
    if s is None:
        return None
    try:
        for e in reversed(_entries(s, prefix)):
            if verify:
                problems = s.verify([e.name])
                if problems:
                    warnings.warn(f"hindsight: skipping damaged checkpoint {e.name}: {problems[0]}", stacklevel=2)
                    continue
            return e.name
        return None
    finally:
        if owned:
            s.close()


def latest_path(
    store: Store | str | os.PathLike[str], prefix: str = DEFAULT_PREFIX, *, verify: bool = False
) -> str | None:
    """``"hindsight://<newest checkpoint>"`` for ``Trainer.fit(ckpt_path=...)``, or None (start afresh)."""
    name = latest(store, prefix, verify=verify)
    return None if name is None else SCHEME + name


def _name_of(path: Any) -> str | None:
    """The checkpoint name of a ``hindsight://<name>`` path, else None."""
    try:
        s = os.fspath(path)
    except TypeError:
        return None
    if not isinstance(s, str):
        return None
    m = _PATH_RE.match(s)
    return m["name"] if m else None


def _pack(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    state = dict(checkpoint)
    sd = state.get("state_dict")
    md = getattr(sd, "_metadata", None)
    if md is not None:
        state[_METADATA_KEY] = {str(k): dict(v) for k, v in md.items()}
    return state


def _unpack(state: dict[str, Any]) -> dict[str, Any]:
    md = state.pop(_METADATA_KEY, None)
    sd = state.get("state_dict")
    if isinstance(sd, dict):
        od = collections.OrderedDict(sd)
        if md is not None:
            od._metadata = md  # type: ignore[attr-defined]
        state["state_dict"] = od
    return state


def _map_location(map_location: Any) -> Any:
    # torch.load's callable map_location has another signature than the
    # store's; Lightning moves the loaded state to the device itself.
    if map_location is None or callable(map_location):
        return None
    return map_location


def load(
    store: Store | str | os.PathLike[str],
    name: str | None = None,
    *,
    prefix: str = DEFAULT_PREFIX,
    map_location: Any = None,
    allow_pickle: bool = False,
) -> dict[str, Any]:
    """The Lightning checkpoint dict ``name`` (a name or ``hindsight://`` path;
    default the newest), e.g. to ``model.load_state_dict(ckpt["state_dict"])``."""
    s, owned = _open(store)
    if s is None:
        raise NotFoundError(f"no hindsight store at {os.fspath(store)}")  # type: ignore[arg-type]
    try:
        if name is None:
            name = latest(s, prefix)
            if name is None:
                raise NotFoundError(f"store {s.path} has no checkpoint with prefix {prefix!r}")
        name = _name_of(name) or name
        return _unpack(s.load(name, map_location=_map_location(map_location), allow_pickle=allow_pickle))
    finally:
        if owned:
            s.close()


# -- the RNG states -----------------------------------------------------------------
# -- what the store holds without pickling ------------------------------------------------------
_KEY_TYPES = (str, int, float, bool, type(None))


def _unsupported(tree: Any, key: str) -> str | None:
    """Key path of the first value the store refuses without allow_pickle, else None."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            ok = isinstance(k, _KEY_TYPES) or (isinstance(k, tuple) and all(isinstance(x, _KEY_TYPES) for x in k))
            if not ok:
                return f"{key} (a dict key of type {type(k).__qualname__})"
            bad = _unsupported(v, f"{key}/{k}")
            if bad:
                return bad
        return None
    if isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            bad = _unsupported(v, f"{key}/{i}")
            if bad:
                return bad
        return None
    if tree is None or isinstance(tree, (str, bool, int, float, bytes, bytearray)):
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tree, torch.Tensor):
        return None
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(tree, np.ndarray) and tree.dtype.kind in "biufc":
            return None
        if isinstance(tree, np.generic) and tree.dtype.kind in "biuf":
            return None
    return f"{key} ({type(tree).__module__}.{type(tree).__qualname__})"


def _build() -> None:
    pl = _import_lightning()
    io_mod = importlib.import_module(pl.__name__ + ".plugins")
    CheckpointIO = io_mod.CheckpointIO
    TorchCheckpointIO = io_mod.TorchCheckpointIO

    class HindsightCheckpointIO(CheckpointIO):  # type: ignore[misc, valid-type]
        """A Lightning ``CheckpointIO`` for ``hindsight://<name>`` paths.

        ``save_checkpoint`` snapshots into the store and returns while the
        write continues (``store.flush()`` or ``teardown`` waits);
        ``load_checkpoint`` verifies every byte; ``remove_checkpoint`` removes
        the manifest (``store.gc()`` reclaims space). Any other path goes to
        ``fallback`` (default ``TorchCheckpointIO``), so ``ModelCheckpoint``
        files keep working. Use as ``Trainer(plugins=[HindsightCheckpointIO(store)])``;
        :class:`HindsightCheckpoint` installs one by itself.
        """

        def __init__(
            self, store: Store | str | os.PathLike[str], *, fallback: Any = None, allow_pickle: bool = False
        ) -> None:
            super().__init__()
            self._store = store if isinstance(store, Store) else None
            self._store_path = store.path if isinstance(store, Store) else os.fspath(store)
            self.fallback = fallback
            self.allow_pickle = allow_pickle

        @property
        def store(self) -> Store:
            if self._store is None:
                self._store = Store(self._store_path)
            return self._store

        def _fallback(self) -> Any:
            if self.fallback is None:
                self.fallback = TorchCheckpointIO()
            return self.fallback

        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            name = _name_of(path)
            if name is None:
                self._fallback().save_checkpoint(checkpoint, path, storage_options=storage_options)
                return
            meta = storage_options if isinstance(storage_options, Mapping) else None
            self.store.save(name, _pack(checkpoint), meta=meta, allow_pickle=self.allow_pickle)
            return None

        def load_checkpoint(
            self, path: Any, map_location: Any = None, weights_only: bool | None = None, **kwargs: Any
        ) -> dict[str, Any]:
            name = _name_of(path)
            if name is None:
                if weights_only is not None:
                    kwargs["weights_only"] = weights_only
                loaded: dict[str, Any] = self._fallback().load_checkpoint(path, map_location=map_location, **kwargs)
                return loaded
            # weights_only: a hindsight checkpoint never runs code when loaded
            # unless allow_pickle=True was chosen for this store.
            return _unpack(
                self.store.load(name, map_location=_map_location(map_location), allow_pickle=self.allow_pickle)
            )

        def remove_checkpoint(self, path: Any) -> None:
            name = _name_of(path)
            if name is None:
                self._fallback().remove_checkpoint(path)
                return
            self.store.remove(name)
            return None

        def teardown(self) -> None:
            if self._store is not None and self._store._pid == os.getpid():
                self._store.flush()
            if self.fallback is not None:
                self.fallback.teardown()

        def __getstate__(self) -> dict[str, Any]:
            state = self.__dict__.copy()
            state["_store"] = None  # reopened from the path in a spawned process
            return state

    class HindsightCheckpoint(pl.Callback):  # type: ignore[misc, name-defined]
        """Checkpoint ``Trainer.fit`` into a hindsight store; stop cleanly on
        preemption signals; keep what the retention policy says.

        See the module documentation (``help(hindsight.lightning)``).
        """

        def __init__(
            self,
            store: Store | str | os.PathLike[str],
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
            allow_pickle: bool = False,
            restore_rng: bool = True,
        ) -> None:
            super().__init__()
            self.prefix = _check_prefix(prefix)
            for arg, v in (
                ("every_n_epochs", every_n_epochs),
                ("every_n_train_steps", every_n_train_steps),
                ("keep_last", keep_last),
                ("keep_best", keep_best),
                ("keep_every", keep_every),
            ):
                if v is not None and (not isinstance(v, int) or v < 1):
                    raise InvalidArgumentError(f"HindsightCheckpoint({arg}={v!r}): must be an int of at least 1")
            if keep_best is not None and not monitor:
                raise InvalidArgumentError("HindsightCheckpoint(keep_best=...) needs monitor='<logged metric>'")
            if mode not in ("min", "max"):
                raise InvalidArgumentError(f"HindsightCheckpoint(mode={mode!r}): use 'min' or 'max'")
            self._store = store if isinstance(store, Store) else None
            self._store_path = store.path if isinstance(store, Store) else os.fspath(store)
            self.every_n_epochs = every_n_epochs
            self.every_n_train_steps = every_n_train_steps
            self.keep_last = keep_last
            self.keep_best = keep_best
            self.monitor = monitor
            self.mode = mode
            self.keep_every = keep_every
            self.exit_code = exit_code
            self.requeue = requeue if requeue is not None else _preemption.requeue_default()
            self.catch_sigint = catch_sigint
            self.allow_pickle = allow_pickle
            self.restore_rng = restore_rng
            self.stop_signal: int | None = None
            self.last_saved: str | None = None
            self._last_step_saved = -1
            self._active = False
            self._prev_handlers: dict[int, Any] = {}

        # -- plumbing ----------------------------------------------------------------
        @property
        def store(self) -> Store:
            if self._store is None:
                self._store = Store(self._store_path)
            return self._store

        @property
        def state_key(self) -> str:
            return str(self._generate_state_key(prefix=self.prefix))

        def __getstate__(self) -> dict[str, Any]:
            state = self.__dict__.copy()
            state["_store"] = None
            state["_prev_handlers"] = {}
            state["_active"] = False
            return state

        latest = staticmethod(latest)
        latest_path = staticmethod(latest_path)
        checkpoints = staticmethod(checkpoints)

        def resume_path(self, *, verify: bool = False) -> str | None:
            """``hindsight://<newest checkpoint of this callback's store and prefix>``, or None."""
            return latest_path(self.store, self.prefix, verify=verify)

        # -- signals -------------------------------------------------------------------
        def _signals(self) -> list[int]:
            return _preemption.signals(self.catch_sigint)

        def _on_signal(self, signum: int, frame: Any) -> None:
            # Only a flag: the checkpoint is written on the training thread at the
            # next step boundary, never inside the handler.
            if self._active:
                if self.stop_signal is None:
                    self.stop_signal = signum
                return
            # Left installed after fit (Lightning's teardown restores the handlers
            # it found, ours among them): behave like the handler we replaced.
            prev = self._prev_handlers.get(signum, signal.SIG_DFL)
            if callable(prev):
                prev(signum, frame)
            elif prev == signal.SIG_DFL and threading.current_thread() is threading.main_thread():
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        def _install_signals(self) -> None:
            if threading.current_thread() is not threading.main_thread():
                return
            for sig in self._signals():
                current = signal.getsignal(sig)
                if current == self._on_signal:
                    continue
                if sig not in self._prev_handlers:
                    self._prev_handlers[sig] = current
                signal.signal(sig, self._on_signal)

        def _fix_lightning_teardown(self, trainer: Any) -> None:
            # Lightning's teardown puts back the handlers it found when fit
            # started, ours among them; make it put back the ones we replaced.
            found = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", None)
            if isinstance(found, dict):
                for sig, handler in list(found.items()):
                    if handler == self._on_signal:
                        found[sig] = self._prev_handlers.get(sig, signal.SIG_DFL)

        def _restore_signals(self, trainer: Any = None) -> None:
            self._active = False
            self._fix_lightning_teardown(trainer)
            if threading.current_thread() is not threading.main_thread():
                return
            for sig, prev in self._prev_handlers.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, prev if prev is not None else signal.SIG_DFL)

        def _should_stop(self, trainer: Any) -> bool:
            stop = self.stop_signal is not None
            if trainer.world_size > 1:
                stop = bool(trainer.strategy.reduce_boolean_decision(stop, all=False))
                if stop and self.stop_signal is None:
                    self.stop_signal = signal.SIGTERM  # another rank got it
            return stop

        def _exit(self, trainer: Any) -> None:
            self._restore_signals(trainer)
            zero = bool(trainer.is_global_zero)  # one rank requeues and speaks for all
            _preemption.leave(
                self.stop_signal, str(self.last_saved), self.exit_code, requeue=self.requeue and zero, announce=zero
            )

        # -- saving -----------------------------------------------------------------------
        def _save(self, trainer: Any, end: bool, wait: bool) -> None:
            epoch = trainer.current_epoch
            step = trainer.global_step
            name = _native.CheckpointId(
                self.prefix, "epoch", epoch, "block" if end else "step", None if end else step
            ).name
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            if trainer.is_global_zero:
                meta: dict[str, object] = {
                    "lightning": pl.__version__,
                    "epoch": epoch,
                    "global_step": step,
                    "kind": "epoch" if end else "step",
                }
                metric = self._metric(trainer) if end else None
                if metric is not None:
                    meta["monitor"] = self.monitor
                    meta["metric"] = repr(metric)
                try:
                    handle = self.store.save(name, _pack(checkpoint), meta=meta, allow_pickle=self.allow_pickle)
                except UnsupportedTypeError as e:
                    raise UnsupportedTypeError(
                        f"{e}. HindsightCheckpoint stores the Lightning checkpoint without pickling; make this "
                        "value a plain type, or pass HindsightCheckpoint(..., allow_pickle=True) if the store is "
                        "trusted (loading then unpickles it)"
                    ) from e
                self.last_saved = name
                self._last_step_saved = step
                if wait:
                    handle.wait()
                    self.store.flush()
                self._apply_retention()
            else:
                self.last_saved = name
                self._last_step_saved = step
            if wait:
                trainer.strategy.barrier("hindsight_checkpoint")

        def _metric(self, trainer: Any) -> float | None:
            if not self.monitor:
                return None
            value = trainer.callback_metrics.get(self.monitor)
            if value is None:
                if self.keep_best is not None and not getattr(self, "_warned_monitor", False):
                    self._warned_monitor = True
                    warnings.warn(
                        f"HindsightCheckpoint: monitor {self.monitor!r} is not among the logged metrics "
                        f"at epoch end ({sorted(trainer.callback_metrics)}); keep_best ignores those epochs",
                        stacklevel=2,
                    )
                return None
            try:
                return float(value)
            except (TypeError, ValueError):
                return None

        def _apply_retention(self, final: bool = False) -> None:
            if self.keep_last is None and self.keep_best is None and self.keep_every is None:
                return
            self.store.apply_retention(
                self.prefix,
                keep_last=self.keep_last,
                keep_best=self.keep_best,
                best_mode=self.mode,
                keep_every=self.keep_every,
                monitor=self.monitor if self.keep_best else None,
            )

        # -- Lightning hooks -------------------------------------------------------------------
        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            # Teach the strategy's CheckpointIO hindsight:// paths before
            # Lightning restores from ckpt_path.
            strategy = trainer.strategy
            io = strategy.checkpoint_io
            if not isinstance(io, HindsightCheckpointIO):
                strategy.checkpoint_io = HindsightCheckpointIO(self.store, fallback=io, allow_pickle=self.allow_pickle)
            elif self.allow_pickle and not io.allow_pickle and io.store.path == self.store.path:
                io.allow_pickle = True

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            if not self.allow_pickle:
                for owner, obj in (("LightningModule", pl_module), ("LightningDataModule", trainer.datamodule)):
                    hparams = getattr(obj, "hparams", None) if obj is not None else None
                    if hparams:
                        bad = _unsupported(dict(hparams), "hyper_parameters")
                        if bad:
                            raise UnsupportedTypeError(
                                f"HindsightCheckpoint: the {owner}'s hyper-parameter at {bad} cannot be stored "
                                "without pickling; save plain values (str, int, float, bool, None, lists, dicts, "
                                "tensors) with save_hyperparameters, or pass HindsightCheckpoint(..., "
                                "allow_pickle=True) if the store is trusted (loading then unpickles it)"
                            )
            self.stop_signal = None
            self._active = True
            self._last_step_saved = trainer.global_step
            self._install_signals()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            # Lightning registered its own SIGTERM handler after on_fit_start
            # (composed with ours); it would stop with exit status 0 and no
            # checkpoint. Take SIGTERM back for the duration of fit.
            self._install_signals()
            self._fix_lightning_teardown(trainer)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            epoch_loop = trainer.fit_loop.epoch_loop
            should_accumulate = getattr(epoch_loop, "_should_accumulate", None)
            if callable(should_accumulate) and should_accumulate():
                return  # mid gradient accumulation: not a step boundary
            if self._should_stop(trainer):
                self._save(trainer, end=False, wait=True)
                self._exit(trainer)
            n = self.every_n_train_steps
            step = trainer.global_step
            if n and step > self._last_step_saved and step % n == 0 and not epoch_loop.batch_progress.is_last_batch:
                self._save(trainer, end=False, wait=False)

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            stop = self._should_stop(trainer)
            n = self.every_n_epochs
            if stop or (n and (trainer.current_epoch + 1) % n == 0):
                self._save(trainer, end=True, wait=stop)
            if stop:
                self._exit(trainer)

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.is_global_zero and self._store is not None:
                self.store.flush()
                self._apply_retention(final=True)
                self.store.gc()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self._restore_signals(trainer)
            # A signal before on_train_start reached Lightning's handler too,
            # which stops with SystemExit(None) (status 0): nothing was trained
            # since the last checkpoint, but the batch system must reschedule.
            if self.stop_signal is not None and isinstance(exception, SystemExit) and not exception.code:
                exception.code = _preemption.exit_code(self.exit_code)

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self._restore_signals(trainer)

        def state_dict(self) -> dict[str, Any]:
            return {"prefix": self.prefix, "rng": _preemption.rng_state() if self.restore_rng else None}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            rng = state_dict.get("rng")
            if self.restore_rng and rng:
                _preemption.set_rng_state(rng)

    for cls in (HindsightCheckpointIO, HindsightCheckpoint):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
    _CLASSES["HindsightCheckpointIO"] = HindsightCheckpointIO
    _CLASSES["HindsightCheckpoint"] = HindsightCheckpoint

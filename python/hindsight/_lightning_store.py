"""`hindsight.lightning`'s functions that need no Lightning (checkpoint
names, listing, the resume walk's `latest`, loading, packing a Lightning
checkpoint dict): apart from the module, so that the classes defined on
first use (`_lightning`) and the Trainer callback import them without an
import circle through the public module."""

from __future__ import annotations

import collections
import importlib
import os
import re
import sys
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

from hindsight import _native, _settings
from hindsight._store import Store
from hindsight.errors import InvalidArgumentError, NotFoundError

SCHEME = "hindsight://"
DEFAULT_PREFIX = "lightning"
# Extra key holding the model state_dict's `_metadata` (module versions), which
# torch.save keeps as an attribute of the OrderedDict and a plain dict loses.
_METADATA_KEY = "hindsight_state_dict_metadata"
_PATH_RE = re.compile(r"^hindsight:/{1,2}(?P<name>[^/]+)$")


# -- which Lightning -------------------------------------------------------------
_PL: Any = None


def _import_lightning() -> Any:
    """`lightning.pytorch` (or `pytorch_lightning`), imported on first use."""
    global _PL
    if _PL is not None:
        return _PL
    forced = _settings.text(_settings.LIGHTNING)
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


def project_store() -> str:
    """Where ``HindsightCheckpoint()`` without a store writes: the store of the
    script's hindsight run (``$HINDSIGHT_STORE``, else ``<project home>/store``)."""
    from hindsight import _run
    from hindsight._run.common import _script_path

    run = _run._RUN
    if run is not None and not run.finished:
        return str(run.store.path)
    return _native.choose_store(_native.project_paths(str(_script_path().parent)).home).location


def _open(store: Store | str | os.PathLike[str] | None) -> tuple[Store | None, bool]:
    """(store, opened here). A path to a store that does not exist yet gives None;
    None is the project's store (`project_store`)."""
    if store is None:
        store = project_store()
    if isinstance(store, Store):
        return store, False
    try:
        return Store(store, create=False), True
    except NotFoundError:
        return None, False


def _entries(store: Store, prefix: str) -> list[Entry]:
    # `.end`: the mark a finished fit leaves (see `_native.choose_fit`), no trainer state.
    return [
        Entry(ck.name, ck.index, ck.kind == "block", -1 if ck.step is None else ck.step)
        for ck in store.checkpoints(prefix)
        if ck.loop_name == "epoch" and ck.kind != "end"
    ]


def checkpoints(store: Store | str | os.PathLike[str] | None = None, prefix: str = DEFAULT_PREFIX) -> list[Entry]:
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


def latest(
    store: Store | str | os.PathLike[str] | None = None, prefix: str = DEFAULT_PREFIX, *, verify: bool = False
) -> str | None:
    """Name of the newest complete checkpoint (epoch-end or mid-epoch) of the
    newest fit under ``prefix``, or None when there is none or that fit
    finished (a finished fit is never resumed: the next ``fit`` starts afresh
    under a prefix of its own, ``<prefix>.fit2``, ``<prefix>.fit3``, ...).

    With ``verify=True`` every byte of the candidate is read and checked first,
    and a damaged checkpoint is skipped (with a warning) for the one before it;
    without it a damaged checkpoint is reported by the load, never returned wrong.
    """
    _check_prefix(prefix)
    if _settings.text(_settings.REPLAY):
        return None  # a `hindsight replay` worker runs the fit from its start, by its plan
    s, owned = _open(store)
    if s is None:
        return None
    try:
        # The newest fit under the prefix, unless it finished: core's resume walk.
        for name in _native.ResumeWalk.fit(s.list(), prefix, "epoch"):
            if verify:
                problems = s.verify([name])
                if problems:
                    warnings.warn(_native.ResumeWalk.damaged(name, problems[0]), stacklevel=2)
                    continue
            return name
        return None
    finally:
        if owned:
            s.close()


def latest_path(
    store: Store | str | os.PathLike[str] | None = None, prefix: str = DEFAULT_PREFIX, *, verify: bool = False
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
    store: Store | str | os.PathLike[str] | None,
    name: str | None = None,
    *,
    prefix: str = DEFAULT_PREFIX,
    map_location: Any = None,
    allow_pickle: bool = False,
) -> dict[str, Any]:
    """The Lightning checkpoint dict ``name`` (a name or ``hindsight://`` path;
    default the newest of the newest fit, finished or not), e.g. to
    ``model.load_state_dict(ckpt["state_dict"])``."""
    s, owned = _open(store)
    if s is None:
        raise NotFoundError(f"no hindsight store at {project_store() if store is None else os.fspath(store)}")  # type: ignore[arg-type]
    try:
        if name is None:
            # The newest model, also of a finished fit (unlike `latest`, which answers "resume where?").
            newest = _native.choose_fit(s.list(), prefix).latest
            if newest is None:
                raise NotFoundError(f"store {s.path} has no checkpoint with prefix {prefix!r}")
            name = newest.name
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

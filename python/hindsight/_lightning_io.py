"""`HindsightCheckpointIO`: Lightning's CheckpointIO for ``hindsight://``
paths, in a module of its own because defining it imports Lightning (the
callback, `_lightning`, and a replay, `_lightning_replay`, use it)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

from hindsight._lightning_store import _import_lightning, _map_location, _name_of, _pack, _unpack
from hindsight._store import Store
from hindsight.errors import ReplayError

pl = _import_lightning()
_io = importlib.import_module(pl.__name__ + ".plugins")
CheckpointIO = _io.CheckpointIO
TorchCheckpointIO = _io.TorchCheckpointIO


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
        # In a replay worker after its fit: the files the recording's
        # checkpoint callbacks named (best, last), as they were when its fit
        # ended ([size, mtime_ns]), and why a path they would have named is unknown.
        self.recorded_files: dict[str, list[int]] | None = None
        self.recorded_dirs: list[str] = []
        self.unknown: dict[str, str] = {}

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
            self._check_recorded(path)
            if weights_only is not None:
                kwargs["weights_only"] = weights_only
            loaded: dict[str, Any] = self._fallback().load_checkpoint(path, map_location=map_location, **kwargs)
            return loaded
        # weights_only: a hindsight checkpoint never runs code when loaded
        # unless allow_pickle=True was chosen for this store.
        return _unpack(self.store.load(name, map_location=_map_location(map_location), allow_pickle=self.allow_pickle))

    def _check_recorded(self, path: Any) -> None:
        """In a replay: a `ckpt_path="best"`/`"last"` file is the one the
        recording's evaluation loaded, unchanged since its fit ended, or the load is refused."""
        if self.recorded_files is None:
            return
        key = os.fspath(path)
        if os.path.normpath(key) in self.unknown:
            raise ReplayError(self.unknown[os.path.normpath(key)])
        want = self.recorded_files.get(os.path.normpath(key))
        if want is None:
            real = os.path.realpath(key)
            inside = [
                d for d in self.recorded_dirs if os.path.commonpath([real, os.path.realpath(d)]) == os.path.realpath(d)
            ]
            if inside:
                raise ReplayError(
                    f"{key} is in {inside[0]}, where the recording's ModelCheckpoint wrote, but was not among "
                    "its files when the recorded fit ended: replay cannot evaluate the model the recording did"
                )
            return  # a path the script names itself
        try:
            st = os.stat(key)
        except OSError as e:
            raise ReplayError(
                f"the recording evaluated {key}, which its ModelCheckpoint wrote; it cannot be read now ({e}), "
                "so replay cannot evaluate the same model"
            ) from None
        if [st.st_size, st.st_mtime_ns] != list(want):
            raise ReplayError(
                f"the recording evaluated {key}, which its ModelCheckpoint wrote; the file was changed since "
                "the recorded fit ended (size or modification time differ), so replay cannot evaluate the same model"
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

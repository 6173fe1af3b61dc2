"""The Python face of the checkpoint store. Torch and numpy knowledge lives
here; bytes, hashing, threads and files are the Rust engine's (`_native`)."""

from __future__ import annotations

import atexit
import builtins
import os
import pickle
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from hindsight import _native
from hindsight._native import SaveHandle as SaveHandle
from hindsight._staging import DeviceCopies, cuda_nbytes, device_fingerprints
from hindsight.errors import HindsightError, UnsupportedTypeError, WrongProcessError, about

MapLocation = Any  # None | str | torch.device | Mapping[str, str] | Callable

# The engine's table (`checkpoint::format::TORCH_DTYPES`): one owner.
_TORCH_DTYPES = frozenset(_native.TORCH_DTYPES)

_live: weakref.WeakSet[Store] = weakref.WeakSet()


def _type_name(obj: object) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


class Store:
    """A directory of deduplicated, checksummed checkpoints with a background writer.

    ``save`` snapshots the state and returns a handle at once; hashing and
    writing happen on Rust threads without the GIL. A checkpoint becomes
    visible (``list``, ``load``) only once all of it is durable.

    ``path`` is a local directory or ``"s3://bucket/prefix"`` for S3-compatible
    object storage, configured by the standard AWS environment variables
    (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
    ``AWS_REGION``). There too a checkpoint is listed only once every object of
    it is uploaded; ``gc`` waits up to 10 minutes for the lease of a writer that
    was killed (see docs/format.md, "Object storage").

    ``local_first`` names a local directory: each save then commits there
    (fast, durable, visible in ``list``) and a background thread uploads it to
    ``path``, chunks first and the manifest last. ``flush``, ``close`` and the
    exit wait for the uploads; an upload failure surfaces there or at the next
    save. Checkpoints a killed process left un-uploaded are uploaded by the
    next ``Store`` opened on the same pair. ``load`` reads the local copy when
    it has one.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        create: bool = True,
        compression: str | None = None,
        zstd_level: int | None = None,
        chunk_size: int | None = None,
        staging_bytes: int | None = None,
        threads: int | None = None,
        local_first: str | os.PathLike[str] | None = None,
    ) -> None:
        self._native = _native.Store(
            os.fspath(path),
            create,
            compression,
            zstd_level,
            chunk_size,
            staging_bytes,
            threads,
            None if local_first is None else os.fspath(local_first),
        )
        self._pid = os.getpid()
        # Device tensors: side-stream copies into a pinned arena the engine
        # writes from (one copy), bounded like staging.
        self._copies = DeviceCopies(self._native.staging_bytes)
        #: Seconds of one-time set-up inside the latest `save` call (fresh
        #: staging memory, pinning): what its blocking time cost beyond the
        #: steady state, which the adaptive policy prices.
        self.last_setup_seconds = 0.0
        _live.add(self)

    # -- properties -------------------------------------------------------
    @property
    def path(self) -> str:
        return self._native.path

    @property
    def local_first(self) -> str | None:
        """The local directory saves commit to first (None: they go to ``path`` directly)."""
        return self._native.local_first

    def uploads_pending(self) -> int:
        """Checkpoints committed locally and not yet uploaded (local-first mode)."""
        return self._native.uploads_pending()

    @property
    def compression(self) -> str:
        return self._native.compression

    @property
    def staging_bytes(self) -> int:
        """Most bytes of copied-but-unwritten data held at once; save waits beyond it."""
        return self._native.staging_bytes

    @property
    def background_cpu_seconds(self) -> float:
        """CPU seconds the background threads have spent on saves so far."""
        return self._native.background_cpu_seconds

    def __repr__(self) -> str:
        return f"hindsight.Store({self.path!r})"

    def _check_owner(self) -> None:
        if os.getpid() != self._pid:
            raise WrongProcessError(
                f"store {self.path} was opened in process {self._pid}; this is process "
                f"{os.getpid()} (a fork, e.g. a DataLoader worker). Open a new Store here to save."
            )

    # -- save ---------------------------------------------------------------
    def save(
        self,
        name: str,
        state: Any,
        *,
        meta: Mapping[str, object] | None = None,
        allow_pickle: bool = False,
        skip_unchanged: bool = True,
    ) -> SaveHandle:
        """Snapshot ``state`` under ``name`` and return while it is written.

        ``state`` is a tree of dict / list / tuple / str / int / float / bool /
        None / bytes, torch tensors and numpy arrays. Once ``save`` returns,
        the caller may modify its tensors. Objects of other types are refused
        (naming their key path) unless ``allow_pickle=True``.

        With ``skip_unchanged``, a tensor is neither copied nor written again
        when its whole content is proven equal to what the previous save of
        this store held: torch's version counter says when it surely changed,
        and otherwise a full-content fingerprint decides (computed in Rust
        for host memory, on the device for device memory), so writes that
        bypass the counter (``.data``, numpy views, shared storages) are saved.
        """

        def describe(obj: Any, key: str) -> Any:
            return self._describe(obj, key, allow_pickle)

        return self._save_described(name, state, describe, meta=meta, skip_unchanged=skip_unchanged)

    def _save_described(
        self,
        name: str,
        state: Any,
        describe: Any,
        *,
        meta: Mapping[str, object] | None,
        skip_unchanged: bool,
        part: bool = False,
    ) -> SaveHandle:
        """`save` with the answer for objects the tree walk does not know
        given by ``describe(obj, key)`` (`hindsight.dist` adds DTensors)."""
        self._check_owner()
        meta_s = {str(k): str(v) for k, v in (meta or {}).items()}
        copies = self._copies
        copies.begin(state)
        out: list[SaveHandle] = []
        try:
            h = self._native.save(
                name,
                state,
                describe,
                copies.copy,
                copies.end,
                device_fingerprints,
                meta_s,
                skip_unchanged,
                None,
                out,
                part,
            )
            self.last_setup_seconds = h.setup_seconds + copies.setup_seconds
            return h
        finally:
            copies.saved(out[0] if out else None)

    def check_state(self, name: str, state: Any, path: list[str] | None = None) -> _native.StateCheck:
        """Compare ``state`` with checkpoint ``name`` (its sub-tree at
        ``path``) without loading it: the live bytes are hashed along the
        checkpoint's chunks (the rule is the engine's ``checkpoint::compare``).
        Device tensors are copied to the host first."""

        def describe(obj: Any, key: str) -> Any:
            return self._describe(obj, key, False)

        return self._check_described(name, state, describe, path)

    def _check_described(
        self, name: str, state: Any, describe: Any, path: builtins.list[str] | None
    ) -> _native.StateCheck:
        """``check_state`` with the caller's ``describe`` (one that says
        which arrays are pieces of sharded ones: ``hindsight.dist``)."""

        def to_host(t: Any) -> tuple[int, Any, None]:
            h = t.detach().to("cpu").contiguous()
            return h.data_ptr(), h, None

        return self._native.check_state(name, state, describe, to_host, path)

    def prepare(self, state: Any, *, wait: bool = False) -> None:
        """Start the one-time set-up for saving ``state`` (pinning host memory
        for its CUDA tensors) on a background thread, so the first ``save``
        does not pay it; ``wait=True`` blocks until it is done. Optional: the
        first save starts it otherwise (``hs.checkpointing`` calls it after
        the first training step)."""
        self._copies.prepare(cuda_nbytes(state))
        if wait:
            self._copies.wait_prepared()

    def _describe(self, obj: Any, key: str, allow_pickle: bool) -> Any:
        """What the engine's tree walk stores for an object it does not
        know: an ArrayView, a Pickled, or a plain value in its place."""
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._describe_tensor(torch, obj, key)
        np = sys.modules.get("numpy")
        if np is not None:
            if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc":
                a = np.ascontiguousarray(obj)
                if a.dtype.byteorder == ">":
                    a = a.astype(a.dtype.newbyteorder("<"))
                return _native.ArrayView(
                    lib="numpy",
                    dtype=a.dtype.str,
                    shape=list(a.shape),
                    ptr=a.ctypes.data,
                    nbytes=a.nbytes,
                    owner=a,
                    device="cpu",
                    host=True,
                )
            if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":
                # numpy scalars load back as the equivalent Python scalar.
                return obj.item()
        if allow_pickle:
            return _native.Pickled(pickle.dumps(obj, protocol=5))
        raise about(
            UnsupportedTypeError(
                f"unsupported type {_type_name(obj)} at key '{key}': hindsight stores dict, list, tuple, "
                "str, int, float, bool, None, bytes, torch tensors and numpy arrays; pass "
                "allow_pickle=True to pickle other objects (loading them then executes code)"
            ),
            key_path=key,
        )

    def _describe_tensor(self, torch: Any, t: Any, key: str) -> _native.ArrayView:
        if type(t).__name__ == "DTensor":
            # Its memory is a shard of a tensor spread over ranks: written
            # here it would be saved as if it were the whole tensor.
            raise about(
                UnsupportedTypeError(
                    f"the DTensor at key '{key}' is a shard of a tensor spread over ranks: save it with "
                    "hindsight.dist.save (every rank), which keeps its place in the whole tensor"
                ),
                key_path=key,
            )
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise about(
                UnsupportedTypeError(
                    f"unsupported tensor at key '{key}': layout {t.layout}, device {t.device.type}, "
                    f"quantized={t.is_quantized}; convert it to a dense tensor first"
                ),
                key_path=key,
            )
        t = t.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _TORCH_DTYPES:
            raise about(UnsupportedTypeError(f"unsupported tensor dtype {t.dtype} at key '{key}'"), key_path=key)
        if not t.is_contiguous():
            t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        host = t.device.type == "cpu"
        return _native.ArrayView(
            lib="torch",
            dtype=dtype,
            shape=list(t.shape),
            ptr=t.data_ptr(),
            nbytes=nbytes,
            owner=t,
            device=str(t.device),
            host=host,
            version=t._version,
        )

    # -- load ---------------------------------------------------------------
    def load(
        self,
        name: str,
        *,
        path: str | Sequence[str] | None = None,
        map_location: MapLocation = None,
        allow_pickle: bool = False,
        threads: int | None = None,
    ) -> Any:
        """Load checkpoint ``name`` (or only the sub-tree at ``path``).

        Every byte read is verified against its hash. ``path`` is a
        "/"-separated key path ("model") or a sequence of keys. Tensors load
        on the CPU unless ``map_location`` says otherwise (a device, a dict
        from saved device to device, or a callable ``f(tensor, saved_device)``).
        Pickled objects are refused unless ``allow_pickle=True``.
        """
        keys: list[str] | None
        if path is None:
            keys = None
        elif isinstance(path, str):
            keys = [p for p in path.split("/") if p]
        else:
            keys = [str(p) for p in path]
        make_array, unpickle = self._builders(name, map_location, allow_pickle)
        return self._native.load(name, make_array, unpickle, keys, threads)

    def _load_leaving_out(
        self, name: str, path: Sequence[str], skip: builtins.list[builtins.list[str]]
    ) -> _native.PartialTree:
        """``load`` of the sub-tree at ``path`` without the arrays at the key
        paths ``skip`` (None in their places; listed with their whole shapes
        for ``read_regions`` to read only the boxes a rank holds)."""
        make_array, unpickle = self._builders(name, None, False)
        return self._native.load_leaving_out(name, make_array, unpickle, list(path), skip)

    def _builders(self, name: str, map_location: MapLocation, allow_pickle: bool) -> tuple[Any, Any]:
        """What a load calls for each array and each pickled object."""

        def make_array(lib: str, dtype: str, shape: tuple[int, ...], buf: Any, device: str | None, key: str) -> Any:
            return _make_array(lib, dtype, shape, buf, device, map_location)

        def unpickle(data: bytes, key: str) -> Any:
            if not allow_pickle:
                raise about(
                    UnsupportedTypeError(
                        f"checkpoint '{name}' holds a pickled object at key '{key}'; unpickling runs code "
                        "from the file, so pass allow_pickle=True only for a store you trust"
                    ),
                    checkpoint=name,
                    key_path=key,
                )
            return pickle.loads(data)

        return make_array, unpickle

    # -- housekeeping ---------------------------------------------------------
    def list(self) -> builtins.list[str]:
        """Names of the committed checkpoints, sorted."""
        return self._native.list()

    def checkpoints(self, prefix: str) -> builtins.list[_native.CheckpointId]:
        """The checkpoints named ``<prefix>.<loop>-<index>[...]`` (as the training
        API and the Lightning callback name them), oldest first in resume order."""
        return self._native.checkpoints(prefix)

    def apply_retention(
        self,
        prefix: str,
        *,
        keep_last: int | None = None,
        keep_best: int | None = None,
        best_mode: str = "min",
        keep_every: int | None = None,
        metrics: Mapping[int, float] | None = None,
        monitor: str | None = None,
        keep_spread: int | None = None,
    ) -> builtins.list[str]:
        """Remove the checkpoints of ``prefix`` that the policy does not keep;
        returns their names. The policies combine as a union and the newest
        checkpoint always stays; interim (mid-iteration) checkpoints go once a
        newer epoch checkpoint exists. ``keep_best`` ranks by ``metrics``
        (outer index -> value) or by the metric saved in each checkpoint's
        metadata under ``monitor``; ``keep_spread=N`` keeps at most N spread
        over the run (indices that are multiples of a power-of-two stride)."""
        return self._native.apply_retention(
            prefix,
            keep_last,
            keep_best,
            best_mode,
            keep_every,
            None if metrics is None else dict(metrics),
            monitor,
            keep_spread,
        )

    def apply_policy(
        self, prefix: str, policy: _native.Retention, metrics: Mapping[int, float] | None = None
    ) -> builtins.list[str]:
        """A session's retention ``policy`` on ``prefix``, every field of it
        (the one place that unpacks it: two copies once dropped
        ``keep_spread``). ``keep_best`` ranks by ``metrics`` when given, else
        by the metric each checkpoint's metadata holds under the policy's name."""
        return self.apply_retention(
            prefix,
            keep_last=policy.keep_last,
            keep_best=policy.keep_best,
            best_mode=policy.best_mode,
            keep_every=policy.keep_every,
            keep_spread=policy.keep_spread,
            metrics=metrics,
            monitor=policy.metric if metrics is None else None,
        )

    def meta(self, name: str) -> dict[str, str]:
        """A checkpoint's metadata (as `info(name)["meta"]`, without listing its entries)."""
        return self._native.meta(name)

    def info(self, name: str) -> dict[str, Any]:
        """Creation time, metadata and the (key, kind, bytes) entries of a checkpoint."""
        return self._native.info(name)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every save so far is durable; raise the first unreported failure.
        Returns False if ``timeout`` seconds passed first."""
        self._check_owner()
        return self._native.flush(timeout)

    def remove(self, name: str) -> None:
        """Remove a checkpoint. Saves still in flight finish first (a pending
        save of ``name`` cannot reappear after the remove; its error, if any,
        is still reported by its handle or the next call). Durable on return;
        ``gc`` reclaims the space."""
        self._native.remove(name)

    def verify(self, names: Sequence[str] | None = None) -> builtins.list[str]:
        """Check every byte of the named checkpoints (default all); returns problems."""
        return self._native.verify(list(names) if names is not None else None)[1]

    def gc(self) -> dict[str, int]:
        """Delete chunks no checkpoint references. Safe while other processes
        save: a save that reuses unchanged tensors checks their chunks under
        the store's lock and copies again any that gc (or quarantine) took.
        Chunks of a save that failed stay until gc."""
        return self._native.gc()

    def usage(self) -> dict[str, int]:
        """Logical bytes vs stored bytes (the dedup ratio), chunk counts."""
        return self._native.usage()

    def staging_in_use(self) -> int:
        return self._native.staging_in_use()

    def close(self) -> None:
        """Flush and stop the writer threads."""
        if os.getpid() != self._pid:
            return
        self._native.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _make_array(
    lib: str, dtype: str, shape: tuple[int, ...], buf: Any, device: str | None, map_location: MapLocation
) -> Any:
    if lib == "numpy":
        import numpy as np

        np_dt = np.dtype(dtype)
        if len(buf) == 0:
            return np.empty(shape, dtype=np_dt)
        return np.frombuffer(buf, dtype=np_dt).reshape(shape)
    import torch

    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise UnsupportedTypeError(f"this torch has no dtype {dtype!r}")
    if len(buf) == 0:
        t = torch.empty(shape, dtype=dt)
    else:
        # Wrap the bytes read from disk (no copy), then reinterpret.
        t = torch.frombuffer(buf, dtype=torch.uint8).view(dt).reshape(shape)
    saved = device or "cpu"
    if map_location is None:
        return t
    if callable(map_location):
        return map_location(t, saved)
    if isinstance(map_location, Mapping):
        target = map_location.get(saved)
        return t if target is None else t.to(target)
    return t.to(map_location)


def _flush_at_exit() -> None:
    """Background failures must not vanish when the interpreter exits."""
    failed = False
    for store in list(_live):
        if store._pid != os.getpid():
            continue  # a forked child never touches its parent's writer
        try:
            store.close()
        except HindsightError as e:
            failed = True
            sys.stderr.write(f"hindsight: error at exit: {e}\n")
    if failed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


atexit.register(_flush_at_exit)

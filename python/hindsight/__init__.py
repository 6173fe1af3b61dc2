"""hindsight: cheap, crash-safe, deduplicated checkpoints for PyTorch training.

store = hindsight.Store("ckpts")
h = store.save("epoch-3", {"model": net.state_dict(), "optim": opt.state_dict()})
...                      # training continues; h.wait() blocks until durable
state = store.load("epoch-3")
"""

from __future__ import annotations

from hindsight import _startup  # first: it times the rest of this import

# isort: split
from hindsight import _preemption
from hindsight._launcher import tie_rank_to_launcher as _tie_rank_to_launcher
from hindsight._query import dataframe
from hindsight._run import arg, args, checkpointing, log, loop, notebook, run_id
from hindsight._run import files as _files
from hindsight._store import SaveHandle, Store
from hindsight.errors import (
    AbandonedError,
    CancelledError,
    ConcurrentChangeError,
    CorruptError,
    DatabaseError,
    DeviceCopyError,
    DivergenceError,
    HindsightError,
    InternalError,
    InvalidArgumentError,
    LeaseLostError,
    NotFoundError,
    ReplayError,
    StorageError,
    StorageFullError,
    StoragePermissionError,
    StoreClosedError,
    UnsupportedTypeError,
    WrongProcessError,
)

__all__ = [
    "AbandonedError",
    "CancelledError",
    "ConcurrentChangeError",
    "CorruptError",
    "DatabaseError",
    "DeviceCopyError",
    "DivergenceError",
    "HindsightError",
    "InternalError",
    "InvalidArgumentError",
    "LeaseLostError",
    "NotFoundError",
    "ReplayError",
    "SaveHandle",
    "StorageError",
    "StorageFullError",
    "StoragePermissionError",
    "Store",
    "StoreClosedError",
    "UnsupportedTypeError",
    "WrongProcessError",
    "arg",
    "args",
    "checkpointing",
    "dataframe",
    "log",
    "loop",
    "notebook",
    "run_id",
]
__version__ = "0.1.0"

# A rank of `python -m hindsight.torchrun` dies with it (see `_launcher`).
_tie_rank_to_launcher()
# A stop signal before the training loop leaves with a word, not killed.
_preemption.install_early()
# A replay worker writes into its own mirror of the recorded directory, also
# before its first hs.* call.
_files.mirror_worker()


def __getattr__(name: str) -> object:
    # `hs.data` (the input service) loads on first use.
    if name in ("data", "dist"):
        import importlib

        return importlib.import_module(f"hindsight.{name}")
    raise AttributeError(f"module 'hindsight' has no attribute {name!r}")


_startup.imported()

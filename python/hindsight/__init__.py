"""hindsight: cheap, crash-safe, deduplicated checkpoints for PyTorch training.

    store = hindsight.Store("ckpts")
    h = store.save("epoch-3", {"model": net.state_dict(), "optim": opt.state_dict()})
    ...                      # training continues; h.wait() blocks until durable
    state = store.load("epoch-3")
"""

from __future__ import annotations

from hindsight._store import SaveHandle, Store
from hindsight.errors import (
    CancelledError,
    CorruptError,
    HindsightError,
    InvalidArgumentError,
    NotFoundError,
    StorageError,
    StorageFullError,
    UnsupportedTypeError,
    WrongProcessError,
)

__all__ = [
    "Store",
    "SaveHandle",
    "HindsightError",
    "NotFoundError",
    "CorruptError",
    "UnsupportedTypeError",
    "InvalidArgumentError",
    "StorageError",
    "StorageFullError",
    "WrongProcessError",
    "CancelledError",
]
__version__ = "0.1.0"

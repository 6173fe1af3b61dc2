"""Exception classes. Every error hindsight raises derives from HindsightError;
each also derives from the builtin a caller would naturally catch. The
binding creates them (one per engine error kind, mapped by an exhaustive
match); this module is where users import them from."""

from __future__ import annotations

from typing import TypeVar

from hindsight._native import (  # created by the binding (crates/hindsight-py/src/errors.rs)
    AbandonedError,
    CancelledError,
    ConcurrentChangeError,
    CorruptError,
    DatabaseError,
    DataError,
    DataMismatchError,
    DataPipelineError,
    DataServiceError,
    DataUnreachableError,
    DeviceCopyError,
    DivergenceError,
    HindsightError,
    InternalError,
    InvalidArgumentError,
    LeaseLostError,
    NoDataWorkersError,
    NonDeterministicDataError,
    NotFoundError,
    ReplayError,
    StorageError,
    StorageFullError,
    StoragePermissionError,
    StoreClosedError,
    UnsupportedTypeError,
    WrongProcessError,
)

E = TypeVar("E", bound=HindsightError)


def about(
    error: E,
    *,
    path: str | None = None,
    checkpoint: str | None = None,
    key_path: str | None = None,
    arg: str | None = None,
) -> E:
    """``error`` with the attributes the engine's errors carry (for errors raised in Python)."""
    error.path, error.checkpoint, error.key_path, error.arg = path, checkpoint, key_path, arg
    return error


__all__ = [
    "AbandonedError",
    "CancelledError",
    "ConcurrentChangeError",
    "CorruptError",
    "DataError",
    "DataMismatchError",
    "DataPipelineError",
    "DataServiceError",
    "DataUnreachableError",
    "DatabaseError",
    "DeviceCopyError",
    "DivergenceError",
    "HindsightError",
    "InternalError",
    "InvalidArgumentError",
    "LeaseLostError",
    "NoDataWorkersError",
    "NonDeterministicDataError",
    "NotFoundError",
    "ReplayError",
    "StorageError",
    "StorageFullError",
    "StoragePermissionError",
    "StoreClosedError",
    "UnsupportedTypeError",
    "WrongProcessError",
]

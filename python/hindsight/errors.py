"""Exception classes. Every error hindsight raises derives from HindsightError;
each also derives from the builtin a caller would naturally catch."""

from __future__ import annotations

from typing import TypeVar


class HindsightError(Exception):
    """Base class of every hindsight error. Errors from the engine carry what
    they are about as attributes (None where it does not apply)."""

    #: True when the error happened in a background save and is reported late.
    background: bool = False
    #: The file or object (``s3://...``) the error is about.
    path: str | None = None
    #: The checkpoint the error is about.
    checkpoint: str | None = None
    #: The key path inside the checkpoint (``model/layer.weight``).
    key_path: str | None = None
    #: The argument an ``InvalidArgumentError`` names.
    arg: str | None = None
    #: The run a ``ReplayError`` or ``DivergenceError`` is about.
    run: str | None = None


class NotFoundError(HindsightError, LookupError):
    """A store, checkpoint or key path that does not exist."""


class CorruptError(HindsightError):
    """Stored bytes fail their checksum or do not parse. Nothing wrong is returned."""


class UnsupportedTypeError(HindsightError, TypeError):
    """A value the format cannot hold; pass allow_pickle=True to pickle it."""


class InvalidArgumentError(HindsightError, ValueError):
    """A bad name, option or argument."""


class StorageError(HindsightError, OSError):
    """An I/O error from the storage."""


class StorageFullError(StorageError):
    """The disk or quota is full. No partial checkpoint became visible."""


class StoragePermissionError(StorageError, PermissionError):
    """Storage refused access: missing permission or credentials."""


class ConcurrentChangeError(StorageError):
    """A conditional write lost a race: another process changed the object first."""


class LeaseLostError(StorageError):
    """The lease protecting a save or gc on object storage was lost; nothing was committed under it."""


class WrongProcessError(HindsightError):
    """A Store used in a process other than the one that opened it (e.g. a fork)."""


class DatabaseError(HindsightError):
    """The run/log database failed (locked too long, unreadable, newer schema)."""


class ReplayError(HindsightError):
    """A replay cannot run as asked (script changed beyond logging, missing checkpoint, ...)."""


class DivergenceError(ReplayError):
    """A replay or a resume computed something other than the recording: a
    step consumed other data, a logged value differs, or the state at a
    checkpoint differs. Raised at the first difference, naming it; nothing
    computed after it is presented as a result."""


class CancelledError(HindsightError):
    """The operation was interrupted or abandoned."""


class StoreClosedError(CancelledError):
    """The store (or its writer) was closed."""


class AbandonedError(CancelledError):
    """A save that never committed: an earlier step of it failed or was interrupted."""


class DeviceCopyError(HindsightError):
    """The device-to-host copy of a save failed (e.g. a CUDA error); the save did not commit."""


class InternalError(HindsightError):
    """A broken invariant inside hindsight (a bug): reported, never papered over."""


class DataError(HindsightError):
    """An error of the input service (``hindsight.data``)."""

    #: The dispatcher or worker address the error is about.
    address: str | None = None
    #: The dataset factory (``module:factory``) the error is about.
    dataset: str | None = None


class DataUnreachableError(DataError, ConnectionError):
    """Nothing answered at the dispatcher or worker address in time."""


class DataMismatchError(DataError, ValueError):
    """A job, protocol or code version that differs from the other side's; the message names the difference."""


class DataPipelineError(DataError):
    """The dataset factory or pipeline raised in a worker; the message holds its traceback."""


class NonDeterministicDataError(DataError):
    """A recomputed unit differs from its first computation: the pipeline is not deterministic."""


class NoDataWorkersError(DataError):
    """No live worker served the dataset within the wait."""


class DataServiceError(DataError):
    """A call inside the input service failed in a way no retry fixes."""


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

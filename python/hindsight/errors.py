"""Exception classes. Every error hindsight raises derives from HindsightError;
each also derives from the builtin a caller would naturally catch."""

from __future__ import annotations


class HindsightError(Exception):
    """Base class of every hindsight error."""

    #: True when the error happened in a background save and is reported late.
    background: bool = False


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


class WrongProcessError(HindsightError):
    """A Store used in a process other than the one that opened it (e.g. a fork)."""


class DatabaseError(HindsightError):
    """The run/log database failed (locked too long, unreadable, newer schema)."""


class ReplayError(HindsightError):
    """A replay cannot run as asked (script changed beyond logging, missing checkpoint, ...)."""


class CancelledError(HindsightError):
    """The operation was abandoned (closed store, interrupted save)."""


__all__ = [
    "HindsightError",
    "NotFoundError",
    "CorruptError",
    "UnsupportedTypeError",
    "InvalidArgumentError",
    "StorageError",
    "StorageFullError",
    "WrongProcessError",
    "CancelledError",
    "DatabaseError",
    "ReplayError",
]

"""What identifies the dataset a job is served from, computed the same way
by the trainer's `Loader` and by every worker (`hindsight data worker`):
its factory's arguments, the digest of its code, and whether it is sharded."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from typing import Any

from hindsight.errors import InvalidArgumentError


def code_version(*objs: Any) -> str:
    """A digest of the source files that define the dataset and collate code:
    workers running other code are refused."""
    h = hashlib.sha256()
    for obj in objs:
        if obj is None:
            continue
        try:
            path = inspect.getsourcefile(obj)
        except TypeError:
            path = None
        if path and os.path.exists(path):
            with open(path, "rb") as f:
                h.update(f.read())
        else:
            h.update(repr(obj).encode())
    return h.hexdigest()[:16]


def canonical_args(args: dict[str, Any]) -> str:
    """The factory's arguments as the job spec and every worker state them:
    a worker built with other arguments serves another dataset."""
    try:
        return json.dumps(args, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"dataset_args must be JSON (workers elsewhere rebuild the dataset from them): {e}"
        ) from e


def is_sharded(ds: object) -> bool:
    """A sharded dataset: ``shards()`` (record counts) and ``open(shard, offset)``."""
    return callable(getattr(ds, "shards", None)) and callable(getattr(ds, "open", None))

"""Counters that wrap the step loop: ``enumerate(hs.loop("step", loader))``.

A resume in the middle of the steps skips the ones already done, so the
step loop yields its first batch at step k. An ``enumerate`` around it
does not know that and counts from 0: the script's ``batch_idx`` (what it
logs, what its ``% log_interval`` tests) would be off by k for the rest of
the epoch, silently (zoo: mnist, vae, imagenet, siamese, word_language_model).

Python gives no way to set an ``enumerate``'s next index, so it is written
in the object's memory, at an offset found by probing an ``enumerate`` of a
known index, and read back through ``__reduce__`` (the index Python itself
reports). Anything unexpected refuses the resume instead of running with a
wrong count.
"""

from __future__ import annotations

import ctypes
import gc
from typing import Any

from hindsight.errors import ReplayError

_PROBE = 0x5EED_CAFE


def _index_offset() -> int | None:
    """Where an enumerate keeps its next index (CPython's ``en_index``), checked."""
    off = object.__basicsize__  # right after the object header
    for want in (_PROBE, 7):
        probe: enumerate[Any] = enumerate((), want)
        if ctypes.c_ssize_t.from_address(id(probe) + off).value != want:
            return None
    return off


def _index(e: enumerate[Any]) -> int:
    return int(e.__reduce__()[1][1])  # (enumerate, (iterator, next index))


def shift_enumerates(it: Any, by: int, where: str) -> int:
    """Advance every ``enumerate`` iterating ``it`` by ``by`` positions; how many there were."""
    if by == 0:
        return 0
    found = [r for r in gc.get_referrers(it) if type(r) is enumerate and r.__reduce__()[1][0] is it]
    if not found:
        return 0
    off = _index_offset()
    for e in found:
        want = _index(e) + by
        if off is not None and want < (1 << 62):
            ctypes.c_ssize_t.from_address(id(e) + off).value = want
        if off is None or _index(e) != want:
            raise ReplayError(
                f"resume at {where}: the steps are counted by an enumerate() around hs.loop, whose count "
                f"this Python ({ctypes.sizeof(ctypes.c_void_p) * 8}-bit, layout not recognised) does not let "
                "hindsight advance; the script's step index would restart at 0. Use the index hs.loop gives: "
                'iterate hs.loop("step", enumerate(loader)) instead'
            )
    return len(found)

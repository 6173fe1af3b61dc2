"""The ``HINDSIGHT_*`` environment variables. Their names, kinds, defaults,
documentation and parsing are the engine's (core ``settings``, printed by
``hindsight settings``); this module gives Python the names (each checked
against the engine's table when imported) and reads values typed. A value
that does not parse raises InvalidArgumentError naming the variable."""

from __future__ import annotations

from hindsight import _native

_KNOWN = {s.name for s in _native.settings()}


def _name(name: str) -> str:
    if name not in _KNOWN:  # a variable the engine does not document
        raise RuntimeError(f"{name} is not in the engine's table of settings (hindsight_core::settings)")
    return name


HOME = _name("HINDSIGHT_HOME")
STORE = _name("HINDSIGHT_STORE")
LOCAL_FIRST = _name("HINDSIGHT_LOCAL_FIRST")
RESUME = _name("HINDSIGHT_RESUME")
RESHARD = _name("HINDSIGHT_RESHARD")
RUN_NAME = _name("HINDSIGHT_RUN_NAME")
SAFETY_MINUTES = _name("HINDSIGHT_SAFETY_MINUTES")
SLURM_REQUEUE = _name("HINDSIGHT_SLURM_REQUEUE")
CATCH_SIGINT = _name("HINDSIGHT_CATCH_SIGINT")
VERBOSE = _name("HINDSIGHT_VERBOSE")
QUIET = _name("HINDSIGHT_QUIET")
REPLAY_FORK = _name("HINDSIGHT_REPLAY_FORK")
LIGHTNING = _name("HINDSIGHT_LIGHTNING")
REPLAY = _name("HINDSIGHT_REPLAY")
EXPLAIN = _name("HINDSIGHT_EXPLAIN")
HEARTBEAT_FD = _name("HINDSIGHT_HEARTBEAT_FD")
PIPES_AT = _name("HINDSIGHT_PIPES_AT")
RECORDED_CWD = _name("HINDSIGHT_RECORDED_CWD")
REPLAY_CONCURRENT = _name("HINDSIGHT_REPLAY_CONCURRENT")


def flag(name: str, default: bool) -> bool:
    v = _native.setting_value(name)
    return default if v is None else bool(v)


def number(name: str) -> float | None:
    v = _native.setting_value(name)
    return None if v is None else float(v)


def text(name: str) -> str | None:
    v = _native.setting_value(name)
    return None if v is None else str(v)

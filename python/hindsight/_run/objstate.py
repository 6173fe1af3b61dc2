"""The state of the Python objects a loop changes, as a tree the store holds.

A loop changes more than numbers and tensors: timm's ``AverageMeter``
(``losses_m.update(...)``), an environment drawing from its own numpy
``Generator`` (``env.step(...)``), an LR scheduler that is not torch's, a
``random.Random``. Each is kept here as a tree of storable values under a
marker key, and put back *into the live object* on restore, so that every
other reference to it sees the restored state.

What cannot be kept exactly (an open file, a lock, a C object without state)
raises `NotKept` with the reason; the caller decides whether that is an error.
Restoring never imports a module and builds nothing but plain instances of
classes the process already has (no pickle: loading runs no stored code).
"""

from __future__ import annotations

import enum
import random
import sys
import types
from collections import OrderedDict, defaultdict
from typing import Any

from hindsight._run import dataiter
from hindsight._run.accelstate import LoopState
from hindsight.errors import ReplayError

#: The key of a marker dict (an encoded object); never a user's key in practice.
MARK = "__hindsight__"
#: Nodes one variable may encode to: past it, encoding a checkpoint would cost
#: more than the state is worth (a dataset object, a vocabulary).
MAX_NODES = 200_000
#: Nesting of containers and objects kept.
MAX_DEPTH = 8
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python


def storage_of(t: Any) -> int | None:
    """The address of a tensor's storage (a DTensor's: its local shard's,
    as it has none of its own), None for an empty one."""
    local = getattr(t, "_local_tensor", None)  # DTensor (FSDP2): only the shard has memory
    if local is not None:
        t = local
    return int(t.untyped_storage().data_ptr()) if t.numel() else None


_CODE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _code_name(v: Any) -> str:
    if isinstance(v, types.ModuleType):
        return v.__name__
    if isinstance(v, types.MethodType):
        return f"{_code_name(v.__func__)} of {type(v.__self__).__qualname__}"
    return f"{getattr(v, '__module__', None) or 'builtins'}.{getattr(v, '__qualname__', repr(v))}"


def _code_ref(v: Any) -> dict[str, Any]:
    return {MARK: "code", "name": _code_name(v)}


def _find_code(name: str) -> Any:
    """The module, class or function `name` names, among those loaded (never an import)."""
    if name in sys.modules:
        return sys.modules[name]
    obj = _loaded(name)
    return obj if isinstance(obj, _CODE) else None


def _loaded(name: str) -> Any:
    """What the dotted `name` names in a module already loaded (never an import), or None."""
    module, _, qual = name.rpartition(".")
    while module:
        mod = sys.modules.get(module)
        if mod is not None:
            obj: Any = mod
            for part in qual.split("."):
                obj = getattr(obj, part, None)
            return obj
        module, _, head = module.rpartition(".")
        qual = f"{head}.{qual}"
    return None


def _accelerator_class() -> Any:
    """accelerate's Accelerator class if the program has imported it."""
    mod = sys.modules.get("accelerate.accelerator")
    return getattr(mod, "Accelerator", None) if mod is not None else None


class NotKept(Exception):
    """The value cannot be kept exactly; the message says why."""


def _qualname(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def _resolve(name: str) -> type | None:
    """The class `name` names, from modules already loaded (never an import)."""
    obj = _loaded(name)
    return obj if isinstance(obj, type) else None


def _plain_class(t: type) -> bool:
    """Instances are their ``__dict__``: classes written in Python that
    neither guard attribute writes nor use slots (DataLoader, nn.Module and
    file objects do one or the other)."""
    for c in t.__mro__[:-1]:
        if not c.__flags__ & _HEAPTYPE or "__slots__" in c.__dict__:
            return False
    cls: Any = t
    has_dict = cls.__dictoffset__ != 0  # a heap type from C (`_thread.lock`) may have none
    return has_dict and cls.__setattr__ is object.__setattr__ and cls.__new__ is object.__new__


class _Encoder:
    def __init__(self, skip: set[int], shared: set[int]):
        self.skip, self.shared = skip, shared
        self.nodes = 0
        self.path: set[int] = set()

    def __call__(self, v: Any, depth: int = 0) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise NotKept(f"its state has more than {MAX_NODES} values")
        if v is None or type(v) in (bool, int, float, str, bytes):
            return v  # the checkpoint format holds integers of any size itself
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(v, torch.Tensor):
            if isinstance(v, torch.nn.Parameter):
                raise NotKept("it holds a parameter of a module that is not checkpointed")
            ptr = storage_of(v)
            if ptr is not None and ptr in self.shared:
                return {MARK: "ref"}  # a view of a checkpointed object's state: restored through it
            return v
        np = sys.modules.get("numpy")
        if np is not None and isinstance(v, (np.ndarray, np.generic)):
            if v.dtype.hasobject:
                raise NotKept("it holds a numpy array of Python objects")
            # A numpy scalar (np.float64: an environment's state) as a 0-d array.
            return v if isinstance(v, np.ndarray) else {MARK: "numpy.scalar", "v": np.asarray(v)}
        if id(v) in self.skip:
            return {MARK: "ref"}  # checkpointed on its own (hs.checkpointing)
        if depth >= MAX_DEPTH:
            raise NotKept(f"it nests deeper than {MAX_DEPTH} levels")
        if id(v) in self.path:
            raise NotKept("it refers to itself")
        self.path.add(id(v))
        try:
            return self._compound(v, depth + 1, np, torch)
        finally:
            self.path.discard(id(v))

    def _compound(self, v: Any, depth: int, np: Any, torch: Any) -> Any:
        t = type(v)
        if t is dict and MARK in v:
            return v  # encoded already (a snapshot taken when an iteration began)
        if t in (list, tuple):
            return t(self(x, depth) for x in v)
        if t in (dict, OrderedDict):
            if all(type(k) is str for k in v):
                d = {k: self(x, depth) for k, x in v.items()}
                return d if t is dict else {MARK: "ordered", "v": d}
            return {MARK: "dict", "keys": [self(k, depth) for k in v], "values": [self(x, depth) for x in v.values()]}
        if np is not None and isinstance(v, np.random.Generator):
            return {MARK: "numpy.Generator", "state": self(v.bit_generator.state, depth)}
        if np is not None and isinstance(v, np.random.RandomState):
            return {MARK: "numpy.RandomState", "state": self(v.get_state(legacy=False), depth)}
        if torch is not None and isinstance(v, torch.Generator):
            return {MARK: "torch.Generator", "device": str(v.device), "state": v.get_state()}
        if torch is not None and isinstance(v, (torch.device, torch.dtype)):
            # Values (a Trainer's `self.device`): kept by name.
            return {MARK: "torch.device" if t is torch.device else "torch.dtype", "v": str(v)}
        if isinstance(v, random.Random):
            return {MARK: "random.Random", "type": _qualname(t), "state": self(v.getstate(), depth)}
        if isinstance(v, enum.Enum):
            return {MARK: "enum", "type": _qualname(t), "name": v.name}  # a singleton: named, not copied
        if isinstance(v, _CODE):
            if depth <= 1:
                raise NotKept(f"a {t.__name__} has no state of its own to keep")
            # Inside a kept object (minGPT's Trainer.callbacks): code, not
            # state; the resumed program holds the same one, by name.
            return _code_ref(v)
        if t is defaultdict:
            f = v.default_factory
            return {
                MARK: "defaultdict",
                "factory": None if f is None else _code_ref(f),
                "keys": [self(k, depth) for k in v],
                "values": [self(x, depth) for x in v.values()],
            }
        data = sys.modules.get("torch.utils.data")
        if dataiter.is_loader_iter(v):
            try:
                return {MARK: "data_iter", **dataiter.encode(v, lambda x: self(x, depth))}
            except ValueError as e:
                raise NotKept(str(e)) from None
        if depth > 1 and data is not None and isinstance(v, (data.DataLoader, data.Dataset, data.Sampler)):
            # An attribute of a kept object (the DDP tutorial's Trainer holds
            # its DataLoader): the data source the code made stays. What it
            # yields is checked against the recording's batch fingerprints.
            return {MARK: "data", "type": _qualname(t)}
        accel = _accelerator_class()
        if accel is not None and isinstance(v, accel):
            # accelerate's Accelerator (a loop calls accumulate/backward on
            # it): its loop state, not its configuration (hindsight.accelerate).
            return {MARK: "accelerate", "type": _qualname(t), "state": self(LoopState(v).state_dict(), depth)}
        if callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None)):
            try:
                state = v.state_dict()
            except Exception as e:  # noqa: BLE001 - named in the reason
                # Accelerate's DataLoaderShard has a state_dict that works only
                # over a torchdata StatefulDataLoader (AttributeError otherwise).
                raise NotKept(f"its state_dict() failed ({type(e).__name__}: {e})") from None
            return {MARK: "state_dict", "type": _qualname(t), "state": self(state, depth)}
        if _plain_class(t):
            try:
                state = {k: self(x, depth) for k, x in vars(v).items()}
            except NotKept as e:
                raise NotKept(f"{e} (in a {t.__qualname__})") from None
            return {MARK: "object", "type": _qualname(t), "state": state}
        raise NotKept(f"a {_qualname(t)} cannot be checkpointed")


def encode(v: Any, skip: set[int] = frozenset(), shared: set[int] = frozenset()) -> Any:  # type: ignore[assignment]
    """`v` as a storable tree. ``skip``: ids of objects checkpointed on their
    own; ``shared``: storages of their tensors. Both are kept as references
    to whatever the restoring process holds there. Raises NotKept."""
    return _Encoder(skip, shared)(v)


MISSING = object()
_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})


def restore(current: Any, saved: Any, name: str) -> Any:
    """The value `name` takes: `saved` decoded, written into `current` in
    place where it is the same kind of object (then `current` itself)."""
    # Containers too are filled in place: code holding the old object
    # (`history.append` bound before the call that resumes) sees the state.
    if type(saved) in (list, tuple):
        same = type(current) is type(saved) and len(current) == len(saved)
        cur = current if same else [MISSING] * len(saved)
        items = [restore(c, s, f"{name}[{i}]") for i, (c, s) in enumerate(zip(cur, saved, strict=True))]
        if type(current) is list and type(saved) is list:
            current[:] = items
            return current
        return type(saved)(items)
    if type(saved) is not dict:
        return saved
    kind = saved.get(MARK)
    if kind is None:
        # Looked up in any mapping (a live state_dict, an OrderedDict), filled in place only in a dict.
        cur = current if isinstance(current, dict) else {}
        d = {k: restore(cur.get(k, MISSING), s, f"{name}[{k!r}]") for k, s in saved.items()}
        if type(current) is dict:
            current.clear()
            current.update(d)
            return current
        return d
    if kind in ("ref", "data"):
        if current is MISSING:
            raise ReplayError(
                f"'{name}' referred to a checkpointed object that the resumed program does not hold there"
            )
        return current
    if kind == "code":
        if isinstance(current, _CODE) and _code_name(current) == saved["name"]:
            return current
        found = _find_code(saved["name"])
        if found is None:
            raise ReplayError(f"'{name}' held {saved['name']}, which this program does not define")
        return found
    if kind == "defaultdict":
        factory = None if saved["factory"] is None else restore(MISSING, saved["factory"], name)
        keys = [restore(MISSING, k, name) for k in saved["keys"]]
        into: defaultdict[Any, Any] = current if isinstance(current, defaultdict) else defaultdict(factory)
        entries = {
            k: restore(into.get(k, MISSING), x, f"{name}[{k!r}]") for k, x in zip(keys, saved["values"], strict=True)
        }
        into.clear()
        into.update(entries)
        return into
    if kind == "data_iter":
        return dataiter.restore(current, saved, name, lambda s: restore(MISSING, s, name))
    if kind == "accelerate":
        accel = _accelerator_class()
        if accel is None or not isinstance(current, accel):
            raise ReplayError(
                f"'{name}' held an accelerate Accelerator; the resumed program holds "
                f"{'nothing' if current is MISSING else type(current).__qualname__} there"
            )
        LoopState(current).load_state_dict(restore(MISSING, saved["state"], name))
        return current
    if kind == "numpy.scalar":
        return saved["v"][()]
    if kind == "ordered":
        return OrderedDict(restore(current, saved["v"], name))
    if kind == "dict":
        keys = [restore(MISSING, k, name) for k in saved["keys"]]
        cur = current if isinstance(current, dict) else {}
        return {
            k: restore(cur.get(k, MISSING), s, f"{name}[{k!r}]") for k, s in zip(keys, saved["values"], strict=True)
        }
    state: Any = saved.get("state")
    if kind == "numpy.Generator":
        np = sys.modules["numpy"]
        st = restore(MISSING, state, name)
        if not isinstance(current, np.random.Generator) or type(current.bit_generator).__name__ != st["bit_generator"]:
            current = np.random.Generator(getattr(np.random, st["bit_generator"])())
        current.bit_generator.state = st
        return current
    if kind == "numpy.RandomState":
        np = sys.modules["numpy"]
        if not isinstance(current, np.random.RandomState):
            current = np.random.RandomState()
        current.set_state(restore(MISSING, state, name))
        return current
    if kind == "torch.device":
        return sys.modules["torch"].device(saved["v"])
    if kind == "torch.dtype":
        dtype = getattr(sys.modules["torch"], saved["v"].removeprefix("torch."), None)
        if not isinstance(dtype, sys.modules["torch"].dtype):
            raise ReplayError(f"'{name}' held {saved['v']}, which this torch does not have")
        return dtype
    if kind == "torch.Generator":
        torch = sys.modules["torch"]
        if not isinstance(current, torch.Generator) or str(current.device) != saved["device"]:
            current = torch.Generator(device=saved["device"])
        current.set_state(state)
        return current
    t: Any = type(current) if _qualname(type(current)) == saved.get("type") else _resolve(saved.get("type", ""))
    if t is None:
        raise ReplayError(f"'{name}' held a {saved.get('type')}, a class this program has not defined")
    if kind == "enum":
        return t[saved["name"]]
    if kind == "random.Random":
        if type(current) is not t:
            current = t()
        current.setstate(restore(MISSING, state, name))
        return current
    if kind == "state_dict":
        if type(current) is not t:
            raise ReplayError(
                f"'{name}' held a {saved['type']} when checkpointed, restored through its load_state_dict; "
                f"the resumed program holds {'nothing' if current is MISSING else type(current).__qualname__} there"
            )
        # Its tensors that belong to a checkpointed object (`raw_model =
        # model.module` of a DDP model given to hs.checkpointing; tied
        # weights) were kept as references: they resolve to the live ones,
        # which the checkpointed object's restore has set.
        current.load_state_dict(restore(current.state_dict(), state, name))
        return current
    if kind == "object" and _plain_class(t):
        if type(current) is not t:
            current = t.__new__(t)
        # Attributes added since (by a replayed script's new code) stay.
        attrs = vars(current)
        attrs.update({k: restore(attrs.get(k, MISSING), s, f"{name}.{k}") for k, s in state.items()})
        return current
    raise ReplayError(f"'{name}': a checkpoint entry of kind {kind!r} this version cannot restore")


def versions(v: Any) -> tuple[int, ...]:
    """The version counters of the tensors in an encoded tree: a snapshot
    whose tensors changed in place since no longer holds what it saw."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    tensor = torch.Tensor
    out: list[int] = []
    stack = [v]
    while stack:
        o = stack.pop()
        t = type(o)
        if t in _SCALARS:
            continue
        if isinstance(o, tensor):
            out.append(o._version)
        elif t is dict or t is OrderedDict:
            stack.extend(o.values())
        elif t is list or t is tuple:
            # An RNG state is a tuple of 625 ints: step over scalars here.
            stack.extend([x for x in o if type(x) not in _SCALARS])
    return tuple(out)

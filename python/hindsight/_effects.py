"""What code added to a training script may change, judged from its source
(`hindsight replay` refuses added code that changes the training it
replays: see `_analysis`). Python's own `ast`, for the reason given there."""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace

# Nesting deeper than this through calls is not followed (recursion).
_MAX_DEPTH = 6


class _Aliases:
    def __init__(self, tree: ast.AST) -> None:
        self.modules: set[str] = set()
        self.direct: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "hindsight":
                        self.modules.add(a.asname or "hindsight")
            elif isinstance(node, ast.ImportFrom) and node.module == "hindsight":
                for a in node.names:
                    self.direct[a.asname or a.name] = a.name
        # Names bound to an hs.loop before the `for` that iterates them
        # (`steps = hs.loop("step", ...) if ... else ...; for b in steps:`):
        # name -> the loop's name.
        self.loops: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                calls = [c for c in ast.walk(node.value) if self.is_call(c, "loop")]
                if calls:
                    assert isinstance(calls[0], ast.Call)
                    first = calls[0].args[0] if calls[0].args else None
                    name = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else "?"
                    for t in node.targets:
                        if isinstance(t, ast.Name):
                            self.loops[t.id] = name

    def is_call(self, node: ast.AST, attr: str) -> bool:
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == attr and isinstance(f.value, ast.Name):
            return f.value.id in self.modules
        return isinstance(f, ast.Name) and self.direct.get(f.id) == attr


def _imported(s: ast.Import | ast.ImportFrom) -> dict[str, str]:
    """name -> what an import binds to it."""
    if isinstance(s, ast.Import):
        return {(a.asname or a.name.split(".")[0]): (a.name if a.asname else a.name.split(".")[0]) for a in s.names}
    return {(a.asname or a.name): f"{'.' * s.level}{s.module}:{a.name}" for a in s.names}


# -- what added code may change ------------------------------------------------
#
# Replay runs the training code again around the added code. Added code that
# changes what that training reads (draws from a random stream it draws from,
# advances an iterator or DataLoader it iterates, runs a model it trains in
# training mode, mutates an object) makes the replayed training differ from
# the recorded one, and so every value logged after it, silently. So every
# added expression is judged, hs.log's arguments included. Python is dynamic:
# a library's functions and methods are taken to only read unless their name
# says otherwise (the lists below); what the script defines (its functions,
# models, loaders, generators) is judged from its source.

# Methods that change their object.
_MUTATORS = frozenset(
    "step zero_grad backward append extend insert pop popitem remove clear update setdefault add discard sort "
    "reverse train eval load_state_dict manual_seed seed shuffle write send put apply reset register_buffer "
    "register_parameter add_module __setitem__ __delitem__ __next__".split()
)
# Container methods that change only their object: fine on a container the
# function being checked made itself.
_CONTAINER_MUTATORS = frozenset(
    "append extend insert pop popitem remove clear update setdefault add discard sort reverse __setitem__".split()
)
# Draws from a random stream (torch's, NumPy's, Python's global one).
_RANDOM = frozenset(
    "rand randn randint randperm rand_like randn_like randint_like bernoulli multinomial normal poisson "
    "dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout rrelu gumbel_softmax "
    "choice choices sample rsample uniform random randrange getrandbits gauss exponential geometric cauchy "
    "log_normal".split()
)
_MUTATING_BUILTINS = frozenset({"next", "setattr", "delattr", "exec", "eval"})
# Builtins that iterate their arguments.
_CONSUMERS = frozenset("iter list tuple set frozenset dict sorted sum min max any all enumerate zip map filter".split())
# Builtins that may be given a model without running it.
_PURE_BUILTINS = frozenset("len isinstance issubclass type id repr str hasattr callable print format hash".split())
# A model's methods that only read it. Anything else called on a model with
# an argument may be a submodule run on its input (`net.encoder(x)`).
_MODULE_READS = frozenset(
    "parameters named_parameters buffers named_buffers children named_children modules named_modules "
    "state_dict get_parameter get_buffer get_submodule extra_repr".split()
)
# Calls that show their object is a model (not `state_dict` or `zero_grad`: an optimizer has them too).
_MODULE_EVIDENCE = frozenset(
    "parameters named_parameters buffers named_buffers children named_children modules named_modules "
    "train eval apply".split()
)
# Attributes that lead from a model to a tensor: a method past one is the tensor's.
_TENSOR_ATTRS = frozenset("weight bias grad data running_mean running_var num_batches_tracked T mT H".split())
# Module classes without parameters or randomness: building and calling one only computes.
_STATELESS = frozenset(
    "Softmax LogSoftmax Sigmoid Tanh ReLU GELU SiLU Identity Flatten CosineSimilarity PairwiseDistance".split()
)
# Wrappers a `for` iterates its argument through (`enumerate(loader)`, `hs.loop("step", loader)`).
_WRAPPERS = frozenset("loop enumerate zip iter tqdm islice cycle".split())
# Values that are a new container.
_CONTAINERS = frozenset("list tuple dict set frozenset sorted range defaultdict OrderedDict Counter deque".split())

_ITERATES = (
    "which draws from torch's random number generator (a DataLoader draws a seed each time it is "
    "iterated) or advances what the training iterates, and so changes the training that follows"
)
_MODEL = (
    "in training mode a model draws dropout masks from torch's random number generator and updates "
    "batch-norm statistics, which changes the training that follows; call it where the script has put "
    "it in eval mode, or log a value the script already computes"
)


def _last(chain: str) -> str:
    return chain.rsplit(".", 1)[-1]


def _root(e: ast.AST) -> ast.Name | None:
    """The name a chain of attributes, indexing and calls starts from: `net` in `net.fc.weight.norm()`."""
    while isinstance(e, (ast.Attribute, ast.Subscript, ast.Call)):
        e = e.func if isinstance(e, ast.Call) else e.value
    return e if isinstance(e, ast.Name) else None


def _seeded(e: ast.AST) -> bool:
    """A new generator seeded with a constant (`np.random.default_rng(0)`,
    `random.Random(0)`, `torch.Generator().manual_seed(0)`): its draws touch
    no stream the training draws from."""
    if not (isinstance(e, ast.Call) and len(e.args) == 1 and not e.keywords):
        return False
    if not (isinstance(e.args[0], ast.Constant) and isinstance(e.args[0].value, int)):
        return False
    name = _last(ast.unparse(e.func))
    if name in ("default_rng", "Random", "RandomState"):
        return True
    f = e.func
    return (
        name == "manual_seed"
        and isinstance(f, ast.Attribute)
        and isinstance(f.value, ast.Call)
        and _last(ast.unparse(f.value.func)) == "Generator"
    )


def _nodes(node: ast.AST) -> Iterator[ast.AST]:
    """`ast.walk` (outermost first), without the inside of seeded generators."""
    todo = deque([node])
    while todo:
        n = todo.popleft()
        if not _seeded(n):
            yield n
            todo.extend(ast.iter_child_nodes(n))


def _statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement a block runs, nested ones included, not into definitions."""
    for s in body:
        yield s
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for name in ("body", "orelse", "finalbody"):
            sub = getattr(s, name, None)
            if isinstance(sub, list):
                yield from _statements([x for x in sub if isinstance(x, ast.stmt)])
        for h in [*getattr(s, "handlers", []), *getattr(s, "cases", [])]:
            yield from _statements(h.body)


def _own(s: ast.stmt) -> list[ast.AST]:
    """The expressions a statement evaluates itself (a compound one: its header)."""
    if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return []
    out: list[ast.AST] = []
    for _, value in ast.iter_fields(s):
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, ast.ExceptHandler):
                out += [v.type] if v.type else []
            elif isinstance(v, ast.match_case):
                out += [v.guard] if v.guard else []
            elif isinstance(v, ast.AST) and not isinstance(v, ast.stmt):
                out.append(v)
    return out


@dataclass(frozen=True)
class _Ctx:
    """Where an expression is judged: at the top of the added code, or inside
    a function of the script that it calls (`function`), whose parameters
    `models` receive models, found in the `entry` mode at the call, and
    `restores` are left in that mode when it returns."""

    function: ast.FunctionDef | ast.AsyncFunctionDef | None = None
    models: frozenset[str] = frozenset()
    entry: tuple[tuple[str, str], ...] = ()
    restores: frozenset[str] = frozenset()
    # Names of containers the function made itself: changing them changes nothing outside.
    own: frozenset[str] = frozenset()
    seen: frozenset[int] = frozenset()


class _Script:
    """What one script's source says about its names (models, loaders,
    functions), and the judgement of an added expression in it: why it may
    change training state, or None."""

    def __init__(self, tree: ast.Module, aliases: _Aliases, core: set[str]) -> None:
        self.aliases = aliases
        self.core = core
        self.imports: dict[str, str] = {}
        # Where each statement is: (owner, field, block, index), for the mode of a model before it.
        self.place: dict[int, tuple[ast.AST, str, list[ast.stmt], int]] = {}
        self.functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.methods: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        self.classes: dict[str, list[ast.ClassDef]] = {}
        self.lambdas: dict[str, ast.Lambda] = {}
        # name -> the values assigned to it (None: bound otherwise, a parameter, a `for` target)
        binds: dict[str, list[ast.expr | None]] = {}
        items: set[str] = set()  # bound as a `for` target somewhere
        direct: set[int] = set()  # names an assignment binds to its value
        calls: list[ast.Call] = []
        iterated: list[ast.expr] = []
        for node in ast.walk(tree):  # outermost first: an assignment before its targets
            for name in ("body", "orelse", "finalbody"):
                block = getattr(node, name, None)
                if isinstance(block, list):
                    for i, s in enumerate(block):
                        if isinstance(s, ast.stmt):
                            self.place[id(s)] = (node, name, block, i)
            if isinstance(node, ast.Call):
                calls.append(node)
            elif isinstance(node, ast.Name):
                if not isinstance(node.ctx, ast.Load) and id(node) not in direct:
                    binds.setdefault(node.id, []).append(None)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self.imports.update(_imported(node))
            elif isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, []).append(node)
                for s in node.body:
                    if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.methods.setdefault(s.name, []).append(s)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.arg):
                binds.setdefault(node.arg, []).append(None)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Name):
                        binds.setdefault(t.id, []).append(node.value)
                        direct.add(id(t))
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                items |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
                if not isinstance(node, ast.comprehension):
                    # A comprehension's iterable is most often a container
                    # (`sum(h.norm() for h in hidden)`, a probe's own): only
                    # a `for` statement's makes a name a source by itself.
                    iterated.append(node.iter)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                binds.setdefault(node.name, []).append(None)
        # ast.walk finds methods too: a method is called on an object, never by its bare name.
        methods = {id(fn) for fs in self.methods.values() for fn in fs}
        self.functions = {
            n: kept for n, fs in self.functions.items() if (kept := [f for f in fs if id(f) not in methods])
        }
        self.model_classes = {
            name for name, cs in self.classes.items() if any("Module" in ast.unparse(b) for c in cs for b in c.bases)
        }
        self.generators = {
            name
            for name, fs in self.functions.items()
            if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for f in fs for n in ast.walk(f))
        }
        self.variables = set(binds)
        for name, values in binds.items():
            if len(values) == 1 and isinstance(values[0], ast.Lambda):
                self.lambdas[name] = values[0]
        # Callables that only compute: a loss or an activation object, an alias of a library function.
        self.stateless = {n for n, vs in binds.items() if all(v is not None and self._stateless(v) for v in vs)}
        # Generators seeded with a constant that the training does not use.
        self.seeded = {n for n, vs in binds.items() if n not in core and all(v is not None and _seeded(v) for v in vs)}
        self.models = {n for n, vs in binds.items() if any(v is not None and self._builds_model(v) for v in vs)}
        self.sources = {n for n, vs in binds.items() if any(v is not None and self._yields(v) for v in vs)}
        if self.model_classes:
            self.models.add("self")
        # What a `for` iterates, unless only ever a container, is a source.
        for e in iterated:
            for n in self._iterated(e):
                if n not in items and not all(v is not None and self._container(v) for v in binds.get(n, [])):
                    self.sources.add(n)
        # Names the script calls: a model, or another object a call may change.
        self.called: set[str] = set()
        for call in calls:
            f = call.func
            if isinstance(f, ast.Name) and f.id in self.variables:
                self.called.add(f.id)
            if isinstance(f, ast.Name) and f.id == "next" and call.args and isinstance(call.args[0], ast.Name):
                self.sources.add(call.args[0].id)
            if isinstance(f, ast.Attribute) and f.attr in _MODULE_EVIDENCE and (r := _root(f.value)) is not None:
                self.models.add(r.id)
            if aliases.is_call(call, "checkpointing"):
                for k in call.keywords:
                    if k.arg and any(w in k.arg for w in ("model", "net", "module")) and isinstance(k.value, ast.Name):
                        self.models.add(k.value.id)
        self.models -= self.stateless | set(self.lambdas) | self.seeded
        self.called -= self.stateless | set(self.lambdas) | self.seeded
        # Memos: calls by a method's name reach every method of that name, again and again.
        self._effects: dict[tuple[int, str, str], str | None] = {}
        self._exits: dict[tuple[int, str, str], str | None] = {}
        self._fine: set[tuple[object, ...]] = set()

    # -- what the script's values are

    def _lib(self, chain: str) -> str:
        """Whose random stream a call draws from."""
        head = chain.split(".")[0]
        where = self.imports.get(head, head)
        for mod, what in (("torch", "torch's"), ("numpy", "NumPy's"), ("random", "Python's")):
            if where.split(":")[0].split(".")[0] == mod:
                return f"{what} random number generator"
        if chain.endswith("_"):  # a tensor filled in place: `x.uniform_()`
            return "torch's random number generator"
        return "a random number generator the training may draw from"

    def _imported_chain(self, v: ast.expr) -> bool:
        while isinstance(v, ast.Attribute):
            v = v.value
        return isinstance(v, ast.Name) and v.id in self.imports

    def _stateless(self, v: ast.expr) -> bool:
        if isinstance(v, ast.Call):
            name = _last(ast.unparse(v.func))
            return name.endswith("Loss") or name in _STATELESS
        # `criterion = F.cross_entropy`: a library function under another name.
        return (
            isinstance(v, (ast.Attribute, ast.Name))
            and self._imported_chain(v)
            and _last(ast.unparse(v)) not in _RANDOM
        )

    def _builds_model(self, v: ast.expr) -> bool:
        """A call that builds a model (its parameters initialized from torch's random number generator)."""
        if not isinstance(v, ast.Call):
            return False
        chain = ast.unparse(v.func)
        name = _last(chain)
        if name.endswith("Loss") or name in _STATELESS or name in ("Parameter", "functional"):
            return False
        if isinstance(v.func, ast.Name) and name in self.model_classes:
            return True
        library = self.imports.get(chain.split(".")[0], "")
        is_nn = ".nn." in f".{chain}." or ".nn" in f".{library}" or "torch.nn" in library
        return (is_nn and name[:1].isupper()) or "models." in chain or name in ("from_pretrained", "create_model")

    def _container(self, v: ast.expr) -> bool:
        if isinstance(
            v, (ast.List, ast.Tuple, ast.Set, ast.Dict, ast.ListComp, ast.SetComp, ast.DictComp, ast.Constant)
        ):
            return True
        return isinstance(v, ast.Call) and _last(ast.unparse(v.func)) in _CONTAINERS

    def _yields(self, v: ast.expr) -> bool:
        """A value whose iteration draws or is consumed: a loader, dataset, sampler, iterator, generator."""
        if isinstance(v, ast.GeneratorExp):
            return True
        if not isinstance(v, ast.Call):
            return False
        chain = ast.unparse(v.func)
        head = self.imports.get(chain.split(".")[0], chain)
        low = chain.lower()
        return (
            any(w in low for w in ("loader", "dataset", "sampler", "iter"))
            or _last(chain) in ("map", "filter", "zip", "enumerate", "reversed")
            or "itertools" in head
            or chain in self.generators
        )

    def _iterated(self, e: ast.expr) -> set[str]:
        """The names a `for` iterates, through wrappers: `loader` in `hs.loop("step", enumerate(loader))`."""
        if isinstance(e, ast.Name):
            return {e.id}
        if isinstance(e, ast.Call) and _last(ast.unparse(e.func)) in _WRAPPERS:
            return {n for a in e.args for n in self._iterated(a)}
        return set()

    def _source(self, e: ast.expr) -> str | None:
        """What `e` is, if iterating or indexing it may draw or consume: a
        loader, a dataset (random transforms), an iterator, or part of one."""
        found = None
        while isinstance(e, (ast.Attribute, ast.Subscript)):
            if isinstance(e, ast.Attribute) and e.attr in ("dataset", "sampler", "batch_sampler"):
                found = ast.unparse(e)
            e = e.value
        return e.id if isinstance(e, ast.Name) and e.id in self.sources else found

    def _model(self, e: ast.expr, ctx: _Ctx) -> ast.Name | None:
        """The model `e` is, or is a submodule of (`net`, `self.net[0]`): a
        name the script uses as a model, then attributes and indexing that
        name no tensor."""
        while isinstance(e, (ast.Attribute, ast.Subscript)):
            if isinstance(e, ast.Attribute) and e.attr in _TENSOR_ATTRS:
                return None
            e = e.value
        return e if isinstance(e, ast.Name) and (e.id in self.models | self.called or e.id in ctx.models) else None

    def _callees(self, call: ast.Call) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, ast.expr | None]]:
        """The script's functions a call runs, each with what its `self` is."""
        f = call.func
        if isinstance(f, ast.Name):
            found: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, ast.expr | None]]
            found = [(fn, None) for fn in self.functions.get(f.id, [])]
            for c in self.classes.get(f.id, []):
                found += [(s, None) for s in c.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"]
            return found
        if isinstance(f, ast.Attribute):
            return [(fn, f.value) for fn in self.methods.get(f.attr, [])]
        return []

    # -- the mode (train or eval) of a model where a statement runs

    def mode(self, obj: ast.expr, at: ast.stmt, ctx: _Ctx) -> str:
        """'eval', 'train' or '?' (unknown): the mode of model `obj` when
        statement `at` runs, from the statements before it, through the
        blocks and loops around it (not into a caller, unless `ctx` says)."""
        root = _root(obj)
        where = self.place.get(id(at))
        if root is None or where is None:
            return "?"
        return self._before(ast.unparse(obj), root.id, *where, ctx, 0)

    def _before(
        self, key: str, root: str, owner: ast.AST, field: str, block: list[ast.stmt], i: int, ctx: _Ctx, depth: int
    ) -> str:
        for s in reversed(block[:i]):
            e = self._effect(s, key, root, depth)
            if e is not None:
                return e
        if isinstance(owner, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return dict(ctx.entry).get(root, "?") if owner is ctx.function else "?"
        where = self.place.get(id(owner))
        if where is None or not isinstance(owner, ast.stmt):  # the module's top, an except handler, a case
            return "?"
        head = {self._effect_of(e, key, root, depth) for e in _own(owner)} - {None}
        if head:
            return "?"  # the header of a loop runs again and again; any change there is unknown
        before = self._before(key, root, *where, ctx, depth)
        # A loop's later iterations start in the mode its body ended in; what
        # follows a try body, in whatever the try body or a handler reached.
        ends: list[list[ast.stmt]] = []
        if isinstance(owner, (ast.For, ast.AsyncFor, ast.While)):
            ends = [owner.body]
        elif isinstance(owner, ast.Try) and field != "body":
            ends = [owner.body, owner.orelse, *(h.body for h in owner.handlers)]
        if any(self._last_effect(b, key, root, depth) not in (None, before) for b in ends):
            return "?"
        return before

    def _last_effect(self, body: list[ast.stmt], key: str, root: str, depth: int) -> str | None:
        for s in reversed(body):
            e = self._effect(s, key, root, depth)
            if e is not None:
                return e
        return None

    def _effect(self, s: ast.stmt, key: str, root: str, depth: int) -> str | None:
        """How statement `s` leaves the mode of model `key` (whose name is
        `root`): None when it cannot change it, 'train', 'eval' or '?'."""
        memo = (id(s), key, root)
        if memo not in self._effects:
            self._effects[memo] = self._effect_uncached(s, key, root, depth)
        return self._effects[memo]

    def _effect_uncached(self, s: ast.stmt, key: str, root: str, depth: int) -> str | None:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return "?" if s.name == root else None
        if any(isinstance(x, (ast.Import, ast.ImportFrom)) and root in _imported(x) for x in _statements([s])):
            return "?"
        if isinstance(s, ast.Assign) and [ast.unparse(t) for t in s.targets] == [root]:
            v = s.value
            if key == root and self._builds_model(v):
                return "train"  # a newly built model trains
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and ast.unparse(v.func.value) == root:
                if v.func.attr in ("to", "cuda", "cpu", "float", "double", "half", "bfloat16"):
                    return None  # `net = net.to(device)`: the same model
            return "?"
        if isinstance(s, ast.Expr) and (set_to := _sets_mode(s.value)) is not None:
            target, mode = set_to
            return mode if key == target or key.startswith((target + ".", target + "[")) else "?"
        simple = not any(isinstance(getattr(s, n, None), list) for n in ("body", "handlers", "cases"))
        found = {self._effect_of(e, key, root, depth) for x in _statements([s]) for e in _own(x)} - {None}
        if not found:
            return None
        return found.pop() if simple and len(found) == 1 else "?"

    def _effect_of(self, e: ast.AST, key: str, root: str, depth: int) -> str | None:
        """How evaluating expression `e` leaves the mode of model `key`."""
        found = set()
        for n in ast.walk(e):
            if isinstance(n, ast.Name) and n.id == root and not isinstance(n.ctx, ast.Load):
                return "?"  # rebound
            if isinstance(n, ast.Call) and (m := self._call_effect(n, key, root, depth)) is not None:
                found.add(m)
        return None if not found else found.pop() if len(found) == 1 else "?"

    def _call_effect(self, call: ast.Call, key: str, root: str, depth: int) -> str | None:
        f = call.func
        if isinstance(f, ast.Attribute) and f.attr in ("train", "eval"):
            return "?"  # not a statement of its own, or of another object (which may be this one)
        callees = self._callees(call)
        if callees:
            if depth >= _MAX_DEPTH:
                return "?"
            found = set()
            for fn, this in callees:
                bound = _bind(fn, call, this)
                inner_key, inner_root = key, root
                for p, a in bound.items():
                    arg = ast.unparse(a)
                    if key == arg or key.startswith((arg + ".", arg + "[")):
                        inner_key, inner_root = p + key[len(arg) :], p
                found.add(self._exit(fn, inner_key, inner_root, depth + 1))
            return found.pop() if len(found) == 1 else "?"
        if self._hs(call):
            return None  # hindsight's own functions do not change a model's mode
        if isinstance(f, ast.Name) and f.id in _PURE_BUILTINS:
            return None
        args = [*call.args, *(k.value for k in call.keywords)]
        if any(isinstance(a, ast.Name) and a.id == root for a in args):
            return "?"  # given to a function that may set it (`torch.compile(net)`)
        return None

    def _exit(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, key: str, root: str, depth: int) -> str | None:
        """The mode a function leaves model `key` in, if it sets it."""
        memo = (id(fn), key, root)
        if memo not in self._exits:
            self._exits[memo] = "?"  # while it is found: a recursive call's effect is unknown
            self._exits[memo] = self._exit_uncached(fn, key, root, depth)
        return self._exits[memo]

    def _exit_uncached(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, key: str, root: str, depth: int) -> str | None:
        body = list(_statements(fn.body))
        if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for s in body for e in _own(s) for n in ast.walk(e)):
            return "?"
        if any(isinstance(s, (ast.Return, ast.Raise)) for s in body if s is not fn.body[-1]):
            return "?"  # leaves early, maybe before it sets the mode back
        return self._last_effect(fn.body, key, root, depth)

    # -- the judgement

    def why(self, node: ast.AST, at: ast.stmt) -> str | None:
        """Why evaluating `node` (in statement `at`) may change training state, or None."""
        fine = set(self._fine)
        reason = self._why(node, at, _Ctx())
        if reason is not None:
            self._fine = fine  # judged fine on the way, maybe assuming what now is not
        return reason

    def _why(self, node: ast.AST, at: ast.stmt, ctx: _Ctx) -> str | None:
        for n in _nodes(node):
            if ctx.function is None and isinstance(n, ast.NamedExpr) and isinstance(n.target, ast.Name):
                if n.target.id in self.core:
                    return f"assigns '{n.target.id}', which the training code uses"
            if isinstance(n, ast.comprehension) and (src := self._source(n.iter)):
                return f"iterates {src}, {_ITERATES}"
            if isinstance(n, ast.Starred) and (src := self._source(n.value)):
                return f"iterates {src}, {_ITERATES}"
            if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load) and (src := self._source(n.value)):
                return (
                    f"indexes {src}, whose items a dataset may make with random transforms "
                    "(drawing from the random number generator the training uses)"
                )
            if isinstance(n, ast.Call) and (why := self._why_call(n, at, ctx)):
                return why
        return None

    def _why_call(self, call: ast.Call, at: ast.stmt, ctx: _Ctx) -> str | None:
        f = call.func
        chain = ast.unparse(f)
        root = _root(f)
        own = root is not None and root.id in ctx.own
        if isinstance(f, ast.Name) and f.id not in self.functions and f.id not in self.classes:
            if f.id in _MUTATING_BUILTINS and f.id not in self.variables:
                return f"calls {f.id}(), which changes the object it is given"
            if f.id in _CONSUMERS:
                for a in call.args:
                    if src := self._source(a):
                        return f"iterates {src}, {_ITERATES}"
            if f.id in self.lambdas:
                why = self._why(self.lambdas[f.id].body, at, ctx)
                return f"calls {f.id}(), which {why}" if why else None
            if f.id in self.variables and f.id not in self.stateless:
                if self.mode(f, at, ctx) == "eval":
                    return None
                if f.id in self.models or f.id in ctx.models:
                    return f"calls {f.id}(), a model: {_MODEL}"
                return f"calls {f.id}(), an object of the script's, which a call may change (a model: {_MODEL})"
            if f.id in _RANDOM and f.id not in self.variables:
                return f"calls {f.id}(), which {self._draws(chain)}"
        if isinstance(f, ast.Attribute):
            # A draw from a generator of its own (`np.random.default_rng(0).normal()`,
            # `torch.randn(3, generator=torch.Generator().manual_seed(0))`) touches no training stream.
            own_stream = self._seeded(f.value) or any(
                k.arg == "generator" and self._seeded(k.value) for k in call.keywords
            )
            if (f.attr.rstrip("_") in _RANDOM or ".random." in f".{chain}.") and not own_stream:
                return f"calls {chain}(), which {self._draws(chain)}"
            if f.attr.endswith("_") and not f.attr.startswith("_"):
                return f"calls {chain}(), an in-place operation"
            if f.attr in _MUTATORS:
                # A function that sets a model's mode and sets it back changes
                # nothing; one that fills its own list neither.
                if f.attr in ("train", "eval") and root is not None and root.id in ctx.restores:
                    return None
                if not (own and f.attr in _CONTAINER_MUTATORS):
                    return f"calls {chain}(), which changes its object"
        if self._builds_model(call):
            return (
                f"calls {chain}(), which builds a model: its parameters are drawn from torch's random number generator"
            )
        callees = self._callees(call)
        if callees:
            return self._why_function(call, callees, at, ctx)
        if isinstance(f, ast.Attribute):
            obj = f.value if f.attr in ("forward", "__call__") else f
            model = self._model(obj, ctx)
            submodule = model is not None and (
                obj is not f
                or f.value is model  # `net.anything(...)`: a model has no tensor methods
                or any(not isinstance(a, ast.Constant) for a in call.args)  # run on its input
            )
            if submodule and f.attr not in _MODULE_READS and self.mode(obj, at, ctx) != "eval":
                return f"calls {chain}(), which may run a model or a submodule of it: {_MODEL}"
        elif isinstance(f, (ast.Subscript, ast.Call)) and any(
            isinstance(n, ast.Name) and n.id in self.variables for n in ast.walk(f)
        ):
            # `net[0](x)`, `getattr(net, "fc")(x)`, `fns[i](x)`: an object of the script's is called.
            if self._model(f, ctx) is None or self.mode(f, at, ctx) != "eval":
                return f"calls {chain}(), an object of the script's, which a call may change (a model: {_MODEL})"
        if not (isinstance(f, ast.Name) and f.id in _PURE_BUILTINS) and not self._hs(call):
            for a in [*call.args, *(k.value for k in call.keywords)]:
                a = a.value if isinstance(a, ast.Starred) else a
                if self._model(a, ctx) is not None and self.mode(a, at, ctx) != "eval":
                    return f"passes {ast.unparse(a)} to {chain}(), which may run it: {_MODEL}"
        return None

    def _seeded(self, e: ast.expr) -> bool:
        return _seeded(e) or (isinstance(e, ast.Name) and e.id in self.seeded)

    def _hs(self, call: ast.Call) -> bool:
        f = call.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            return f.value.id in self.aliases.modules
        return isinstance(f, ast.Name) and f.id in self.aliases.direct

    def _draws(self, chain: str) -> str:
        return (
            f"draws from {self._lib(chain)}, which changes the training that follows; draw from a "
            "separate generator seeded with a constant (torch.Generator().manual_seed(0), "
            "np.random.default_rng(0), random.Random(0)) or log a value the script already computes"
        )

    def _why_function(
        self,
        call: ast.Call,
        callees: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, ast.expr | None]],
        at: ast.stmt,
        ctx: _Ctx,
    ) -> str | None:
        """Why running a function of the script (its whole body) may change training state."""
        name = ast.unparse(call.func)
        if len(ctx.seen) >= _MAX_DEPTH:
            return f"calls {name}(), too deep in calls to follow"
        for fn, this in callees:
            if id(fn) in ctx.seen:
                continue  # recursion: judged where it started
            bound = _bind(fn, call, this)
            models = {p: a for p, a in bound.items() if self._model(a, ctx) is not None}
            entry = {p: self.mode(a, at, ctx) for p, a in models.items()}
            # A model the function leaves in the mode it found it in: `evaluate(net)`
            # with model.eval() ... model.train() where the model trains.
            restores = {p for p, m in entry.items() if m != "?" and self._exit(fn, p, p, 0) in (None, m)}
            own = {"self"} if fn.name == "__init__" and this is None else set()
            inner = _Ctx(
                fn, frozenset(models), tuple(entry.items()), frozenset(restores), frozenset(own), ctx.seen | {id(fn)}
            )
            memo = (id(fn), inner.models, inner.entry, inner.restores, inner.own)
            if memo in self._fine:
                continue
            why = self._why_body(fn, inner)
            if why:
                return f"calls {name}(), which {why}"
            self._fine.add(memo)
        return None

    def _why_body(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, ctx: _Ctx) -> str | None:
        body = list(_statements(fn.body))
        params = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
        # Containers the function makes (a list it appends to): its own to change.
        made: dict[str, bool] = {}
        for s in body:
            if isinstance(s, (ast.Assign, ast.AnnAssign)) and s.value is not None:
                for t in s.targets if isinstance(s, ast.Assign) else [s.target]:
                    if isinstance(t, ast.Name):
                        made[t.id] = made.get(t.id, True) and self._container(s.value)
        ctx = replace(ctx, own=ctx.own | {n for n, ok in made.items() if ok and n not in params})
        for s in body:
            if isinstance(s, (ast.Global, ast.Nonlocal)):
                return f"declares {', '.join(s.names)} {type(s).__name__.lower()} (line {s.lineno})"
            targets = (
                s.targets
                if isinstance(s, (ast.Assign, ast.Delete))
                else [s.target]
                if isinstance(s, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor))
                else [i.optional_vars for i in s.items if i.optional_vars]
                if isinstance(s, (ast.With, ast.AsyncWith))
                else []
            )
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, (ast.Attribute, ast.Subscript)) and not isinstance(n.ctx, ast.Load):
                        r = _root(n)
                        if r is None or r.id not in ctx.own:
                            return f"stores into {ast.unparse(n)} (line {s.lineno})"
            if isinstance(s, (ast.For, ast.AsyncFor)) and (src := self._source(s.iter)):
                return f"iterates {src} (line {s.lineno}), {_ITERATES}"
            for e in _own(s):
                if why := self._why(e, s, ctx):
                    return f"{why} (line {s.lineno})"
        return None


def _sets_mode(e: ast.expr) -> tuple[str, str] | None:
    """(`net`, mode) for `net.eval()`, `net.train()`, `net.train(False)`."""
    if not (isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in ("train", "eval")):
        return None
    target = ast.unparse(e.func.value)
    if e.func.attr == "eval" and not e.args and not e.keywords:
        return target, "eval"
    flag = e.args[0] if e.args else e.keywords[0].value if e.keywords and e.keywords[0].arg == "mode" else None
    if flag is None:
        return target, "train"
    if isinstance(flag, ast.Constant) and isinstance(flag.value, bool):
        return target, "train" if flag.value else "eval"
    return target, "?"


def _bind(fn: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call, this: ast.expr | None) -> dict[str, ast.expr]:
    """The function's parameters -> the call's arguments (`self` -> the object of a method call)."""
    params = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]
    args: list[ast.expr] = ([this] if this is not None else []) + list(call.args)
    bound = {p: a for p, a in zip(params, args, strict=False) if not isinstance(a, ast.Starred)}
    bound.update({k.arg: k.value for k in call.keywords if k.arg})
    return bound

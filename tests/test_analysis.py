"""Which added code replay accepts as observing only (seed 000's side-effect
rules): hs.log, helper variables, `if` guards, imports and prints that write
nothing the training reads. Anything else is refused, naming the statement."""

from __future__ import annotations

import ast
import contextlib
import textwrap

import pytest

from hindsight._analysis import analyze, transplant

RECORDED = textwrap.dedent(
    """\
    import math
    import random
    import torch
    import hindsight as hs

    net = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for epoch in hs.loop("epoch", range(3)):
        for step in hs.loop("step", range(4)):
            x = torch.randn(8, 2)
            loss = net(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            hs.log("loss", loss.item())
        print("epoch", epoch)
    """
)


def with_added(after: str, code: str, script: str = RECORDED) -> str:
    """`script` with `code` (indented like `after`) inserted after the line `after`."""
    lines = script.splitlines(keepends=True)
    i = next(n for n, line in enumerate(lines) if line.strip() == after)
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    block = "".join(indent + line + "\n" for line in textwrap.dedent(code).splitlines())
    return "".join([*lines[: i + 1], block, *lines[i + 1 :]])


ACCEPTED = {
    "if_guard": ("opt.step()", 'if step % 2 == 0:\n    hs.log("w", net.weight.norm().item())'),
    "helper_variable": (
        "opt.step()",
        'gnorm = sum(p.grad.norm() ** 2 for p in net.parameters()) ** 0.5\nhs.log("gnorm", float(gnorm))',
    ),
    "import_and_helper": (
        'print("epoch", epoch)',
        'import statistics\nratio = math.sqrt(epoch + 1)\nhs.log("ratio", statistics.mean([ratio, 1.0]))',
    ),
    "reimport": ("import torch", "import math"),
    "guard_with_else_and_print": (
        "opt.step()",
        'if step == 3:\n    hs.log("last", loss.item())\nelse:\n    print("step", step)',
    ),
    "nested_guard": (
        'print("epoch", epoch)',
        'if epoch > 0:\n    scale = 2.0\n    if epoch % 2:\n        hs.log("odd", scale * epoch)',
    ),
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_observing_code_is_accepted_and_its_probes_found(case: str) -> None:
    after, code = ACCEPTED[case]
    a = analyze(RECORDED, with_added(after, code), "train.py")
    assert a.compatible, a.differences
    names = {p.name for p in a.new_probes}
    logged = {line.split('"')[1] for line in code.splitlines() if "hs.log(" in line}
    assert names == logged


REFUSED = {
    "assigns_training_variable": ("opt.step()", "loss = loss.detach()", "assigns 'loss', which the training code uses"),
    "in_place": ("opt.step()", "w = net.weight.mul_(1.0)", "net.weight.mul_(), an in-place operation"),
    "attribute_store": ("opt.step()", "net.weight.requires_grad = False", "net.weight.requires_grad = False"),
    "mutating_method": ("opt.step()", "if step == 0:\n    opt.step()", "opt.step(), which changes its object"),
    "random_draw": ("opt.step()", "noise = torch.randn(1)", "draws from torch's random number generator"),
    "python_random": (
        'print("epoch", epoch)',
        "pick = random.random()",
        "draws from Python's random number generator",
    ),
    "consumes_iterator": ("opt.step()", "peek = next(iter([1]))", "next(), which changes the object"),
    "walrus_in_guard": ("opt.step()", 'if (loss := 0.0) == 0.0:\n    hs.log("z", 0)', "assigns 'loss'"),
    "rebinding_import": ("opt.step()", "import numpy as torch", "imports into 'torch'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_code_that_writes_training_state_is_refused_with_the_reason(case: str) -> None:
    after, code, says = REFUSED[case]
    a = analyze(RECORDED, with_added(after, code), "train.py")
    assert not a.compatible
    text = "\n".join(a.differences)
    assert says in text, text


def test_a_guard_in_the_recorded_script_and_the_current_one_is_no_difference() -> None:
    guarded = with_added("opt.step()", 'if step % 2 == 0:\n    hs.log("w", 1.0)')
    a = analyze(guarded, with_added("opt.step()", 'if step % 2 == 0:\n    hs.log("w", 1.0)\nhs.log("v", 2.0)'))
    assert a.compatible and [p.name for p in a.new_probes] == ["v"]


def test_a_transplanted_statement_that_reads_an_added_helper_is_refused() -> None:
    from hindsight._analysis import transplant

    current = with_added('print("epoch", epoch)', 'ratio = epoch / 3\nprint("r")\nhs.log("ratio", ratio)')
    older = RECORDED.replace('        print("epoch", epoch)\n', '        print("epoch", epoch)\n        print("r")\n')
    src, problems = transplant(older, current, "train.py")
    assert src is None
    assert problems == ["hs.log('ratio') at line 19: reads ratio, which the recorded script does not define"]
    # A statement reading only what the older version defines is placed.
    src, problems = transplant(
        older, with_added('print("epoch", epoch)', 'hs.log("e", sum(math.sqrt(q) for q in [epoch]))'), "t.py"
    )
    assert problems == [] and src is not None and "math.sqrt(q) for q in [epoch]" in src


LIGHTNING = textwrap.dedent(
    """\
    import torch
    import lightning.pytorch as pl
    import hindsight as hs

    class M(pl.LightningModule):
        def report(self):
            pass

        def on_validation_epoch_end(self):
            self.report()

        def on_train_epoch_start(self):
            pass

        def training_step(self, batch, batch_idx):
            return self.net(batch).sum()
    """
)


@pytest.mark.parametrize(
    ("after", "probe", "inner", "start"),
    [
        ("def on_validation_epoch_end(self):", 'hs.log("a", 1.0)', False, False),
        ("def report(self):", 'hs.log("a", 1.0)', False, False),  # a helper only an epoch-end hook calls
        ("def on_train_epoch_start(self):", 'hs.log("a", 1.0)', False, True),
        ("def training_step(self, batch, batch_idx):", 'hs.log("a", 1.0)', True, True),
    ],
)
def test_probes_in_framework_hooks_are_placed_by_the_hook(after: str, probe: str, inner: bool, start: bool) -> None:
    """In a script whose loops a framework runs (Lightning), a probe's hook
    says what state it needs: an epoch-end hook (or a helper only such hooks
    call) the epoch's checkpoint, on_train_epoch_start the previous epoch's,
    a per-step hook the steps themselves."""
    lines = LIGHTNING.splitlines(keepends=True)
    i = next(n for n, line in enumerate(lines) if line.strip() == after)
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())] + "    "
    current = "".join([*lines[: i + 1], indent + probe + "\n", *lines[i + 1 :]])
    a = analyze(LIGHTNING, current)
    assert a.compatible and [p.name for p in a.new_probes] == ["a"]
    a.framework = True
    assert (a.needs_inner_execution, a.needs_start_state) == (inner, start)
    # Without a framework's recorded loops, a hook's place is unknown.
    a.framework = False
    assert (a.needs_inner_execution, a.needs_start_state) == (True, True)


NEW_HOOK = "    def on_validation_epoch_end(self):\n        hs.log('enc', self.net.weight.norm().item())\n"


@pytest.mark.parametrize(
    ("header", "method", "compatible"),
    [
        ("import lightning.pytorch as pl\nclass M(pl.LightningModule):", NEW_HOOK, True),
        ("import lightning as L\nclass M(L.LightningModule):", NEW_HOOK, True),
        ("from lightning.pytorch import LightningModule\nclass M(LightningModule):", NEW_HOOK, True),
        ("import pytorch_lightning as pl\nclass M(pl.Callback):", NEW_HOOK.replace("(self)", "(self, t, m)"), True),
        # Lightning's base does something there, or checks whether it is overridden.
        (
            "import lightning.pytorch as pl\nclass M(pl.LightningModule):",
            NEW_HOOK.replace("on_validation_epoch_end", "setup"),
            False,
        ),
        (
            "import lightning.pytorch as pl\nclass M(pl.LightningModule):",
            NEW_HOOK.replace("on_validation_epoch_end", "validation_step"),
            False,
        ),
        # A base of the script's own (or anyone's) may define the hook: overriding it changes the training.
        ("import lightning.pytorch as pl\nclass B(pl.LightningModule):\n    pass\nclass M(B):", NEW_HOOK, False),
        ("import torch\nclass M(torch.nn.Module):", NEW_HOOK, False),
        (
            "import lightning.pytorch as pl\nfrom mixins import Mixin\nclass M(Mixin, pl.LightningModule):",
            NEW_HOOK,
            False,
        ),
        # A second definition replaces the recorded one.
        (
            "import lightning.pytorch as pl\nclass M(pl.LightningModule):\n"
            "    def on_validation_epoch_end(self):\n        self.x = 1",
            NEW_HOOK,
            False,
        ),
        # More than observing code, or a decorator.
        ("import lightning.pytorch as pl\nclass M(pl.LightningModule):", NEW_HOOK + "        self.x = 1\n", False),
        ("import lightning.pytorch as pl\nclass M(pl.LightningModule):", "    @staticmethod\n" + NEW_HOOK, False),
    ],
)
def test_a_new_lightning_hook_holding_only_probes_is_observing_code(header: str, method: str, compatible: bool) -> None:
    """A hook method the recording did not have, added only to hold hs.log
    (LightningCLI users add `on_validation_epoch_end` to probe), is no change
    to the training where it overrides Lightning's own no-op hook of a direct
    Lightning base class; anywhere else it is refused."""
    recorded = f"import hindsight as hs\n{header}\n    def training_step(self, batch, i):\n        return self.net(batch).sum()\n"
    current = recorded + method
    a = analyze(recorded, current)
    assert a.compatible == compatible, a.differences
    assert [p.name for p in a.new_probes] == ["enc"]
    if compatible:
        a.framework = True
        assert (a.needs_inner_execution, a.needs_start_state) == (False, False)


# -- what a new hs.log's arguments (and the observing code around it) may change

TRAIN = textwrap.dedent(
    """\
    import random

    import numpy as np
    import torch
    import hindsight as hs

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    val_x, val_y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    history = []


    def evaluate(model):
        model.eval()
        with torch.no_grad():
            acc = (model(val_x).argmax(1) == val_y).float().mean().item()
        model.train()
        return acc


    with hs.checkpointing(model=net, optimizer=opt):
        for epoch in hs.loop("epoch", range(2)):
            for x, y in hs.loop("step", loader):
                out = net(x)
                loss = torch.nn.functional.cross_entropy(out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                history.append(loss.item())
                hs.log("loss", loss.item())
            net.eval()
            with torch.no_grad():
                val_loss = torch.nn.functional.cross_entropy(net(val_x), val_y)
            net.train()
            hs.log("val_loss", val_loss.item())
    """
)
STEP = "opt.step()"
EVAL = "val_loss = torch.nn.functional.cross_entropy(net(val_x), val_y)"  # in the eval-mode block
EPOCH = 'hs.log("val_loss", val_loss.item())'  # at the epoch's end, the model training

DRAWS = "draws from torch's random number generator, which changes the training that follows"
MODEL = "a model: in training mode a model draws dropout masks from torch's random number generator"
ITERATES = "iterates loader, which draws from torch's random number generator"
PROBE_REFUSED = {
    # draws from a random stream the training draws from
    "randn": (STEP, 'hs.log("noise", torch.randn(1).item())', f"calls torch.randn(), which {DRAWS}"),
    "python_random": (STEP, 'hs.log("r", random.random())', "calls random.random(), which draws from Python's"),
    "numpy_random": (STEP, 'hs.log("r", np.random.rand())', "calls np.random.rand(), which draws from NumPy's"),
    "rand_like": (STEP, 'hs.log("r", torch.rand_like(x).sum())', f"calls torch.rand_like(), which {DRAWS}"),
    "randint": (STEP, 'hs.log("r", torch.randint(0, 2, (1,)).item())', f"calls torch.randint(), which {DRAWS}"),
    "multinomial": (STEP, 'hs.log("r", torch.multinomial(out.softmax(1)[0], 1).item())', "calls torch.multinomial()"),
    "bernoulli": (STEP, 'hs.log("r", torch.bernoulli(out.sigmoid()).sum())', f"calls torch.bernoulli(), which {DRAWS}"),
    "normal": (STEP, 'hs.log("r", torch.normal(0.0, 1.0, (1,)).item())', f"calls torch.normal(), which {DRAWS}"),
    "uniform_": (
        STEP,
        'hs.log("r", torch.empty(1).uniform_().item())',
        f"calls torch.empty(1).uniform_(), which {DRAWS}",
    ),
    "randperm": (STEP, 'hs.log("r", torch.randperm(4)[0].item())', f"calls torch.randperm(), which {DRAWS}"),
    "unseeded_generator": (
        STEP,
        'hs.log("r", np.random.default_rng().normal())',
        "calls np.random.default_rng().normal(), which draws from NumPy's",
    ),
    # advances an iterator, or iterates a DataLoader (which draws its seed from torch's generator)
    "next_iter": (STEP, 'hs.log("m", next(iter(loader))[0].mean())', "calls next(), which changes the object"),
    "iter_loader": (STEP, 'hs.log("n", len(list(iter(loader))))', ITERATES),
    "loop_over_loader": (STEP, 'hs.log("n", sum(len(b[0]) for b in loader))', ITERATES),
    "index_dataset": (STEP, 'hs.log("d", data[0][0].sum())', "indexes data, whose items a dataset may make"),
    # runs the model in training mode (dropout draws, batch-norm statistics update)
    "model_training": (STEP, 'hs.log("out", net(x).mean())', f"calls net(), {MODEL}"),
    "model_after_train": (
        "net.train()",
        'hs.log("acc", (net(val_x).argmax(1) == val_y).float().mean())',
        "calls net()",
    ),
    "submodule": (STEP, 'hs.log("h", net[0](x).mean())', "calls net[0](), an object of the script's"),
    "forward": (STEP, 'hs.log("h", net.forward(x).mean())', "calls net.forward(), which may run a model"),
    "model_given_away": (STEP, 'hs.log("c", torch.compile(net) is None)', "passes net to torch.compile()"),
    # changes an object
    "add_": (STEP, 'hs.log("b", net[0].bias.data.add_(1.0).sum())', "calls net[0].bias.data.add_(), an in-place"),
    "zero_": (STEP, 'hs.log("g", net[0].weight.grad.zero_().sum())', "calls net[0].weight.grad.zero_(), an in-place"),
    "copy_": (STEP, 'hs.log("x", x.copy_(x * 2).sum())', "calls x.copy_(), an in-place operation"),
    "step": (STEP, 'hs.log("s", opt.step())', "calls opt.step(), which changes its object"),
    "backward": (STEP, 'hs.log("b", loss.backward())', "calls loss.backward(), which changes its object"),
    "append": (STEP, 'hs.log("h", history.append(0.0))', "calls history.append(), which changes its object"),
    "pop": (STEP, 'hs.log("h", history.pop())', "calls history.pop(), which changes its object"),
    "update": (STEP, 'hs.log("u", opt.param_groups[0].update(lr=1.0))', "calls opt.param_groups[0].update(), which"),
    "setattr": (STEP, 'hs.log("s", setattr(net, "training", False))', "calls setattr(), which changes the object"),
    "walrus": (STEP, 'hs.log("l", (loss := loss * 2).item())', "assigns 'loss', which the training code uses"),
    "del": (STEP, "del out", "deletes out"),
    # a function of the script that leaves the model in another mode than it found it in
    "function": (EVAL, 'hs.log("acc", evaluate(net))', "calls evaluate(), which calls model.eval(), which changes"),
    # the same in the observing code around a probe: a helper variable, a guard, a print
    "helper": (STEP, 'probe = net(x)\nhs.log("p", probe.mean())', f"calls net(), {MODEL}"),
    "guard": (STEP, 'if sum(1 for _ in loader) > 3:\n    hs.log("g", 1)', ITERATES),
    "print": (STEP, "print(net(x).mean())", f"calls net(), {MODEL}"),
}


def line_of(script: str, after: str) -> int:
    """The line a statement inserted after the line `after` gets."""
    return next(n for n, line in enumerate(script.splitlines(), 1) if line.strip() == after) + 1


@pytest.mark.parametrize("case", list(PROBE_REFUSED))
def test_a_new_probe_that_changes_the_training_is_refused_naming_it(case: str) -> None:
    """What a new hs.log's argument does runs in replay before the training
    that follows: a draw from its random stream, an iterator or DataLoader
    advanced, the model run in training mode, an object changed all make
    the replayed training differ, silently. Each is refused, naming the
    statement, its line and why."""
    after, code, says = PROBE_REFUSED[case]
    a = analyze(TRAIN, with_added(after, code, TRAIN), "train.py")
    assert not a.compatible
    statement = ast.unparse(ast.parse(code).body[0]).splitlines()[0]
    text = "\n".join(a.differences)
    assert f"line {line_of(TRAIN, after)}: {statement}: {says}" in text, text


PROBE_ACCEPTED = {
    "loss": (STEP, 'hs.log("loss2", loss.item())'),
    "weight_norm": (STEP, 'hs.log("w", net[0].weight.norm().item())'),
    "lr": (STEP, 'hs.log("lr", opt.param_groups[0]["lr"])'),
    "accuracy": (STEP, 'hs.log("acc", (out.argmax(1) == y).float().mean())'),
    "grad_norm": (STEP, 'hs.log("gn", sum(p.grad.norm() for p in net.parameters()))'),
    "loader_length": (STEP, 'hs.log("n", len(loader))'),
    "state_dict": (STEP, 'hs.log("k", len(net.state_dict()))'),
    "history": (STEP, 'hs.log("h", history[-1])'),
    # iterates a model's output (an LSTM's hidden-state tuple in the zoo's word_language_model)
    "iterate_output": (STEP, 'hs.log("o", sum(r.abs().sum().item() for r in out))'),
    # draws from a generator of its own, seeded with a constant
    "seeded_numpy": (STEP, 'hs.log("e", np.random.default_rng(0).normal())'),
    "seeded_torch": (STEP, 'hs.log("t", torch.randn(1, generator=torch.Generator().manual_seed(0)).item())'),
    "seeded_python": (STEP, 'hs.log("p", random.Random(0).random())'),
    # the model where the script has put it in eval mode
    "model_in_eval": (EVAL, 'hs.log("val_acc", (net(val_x).argmax(1) == val_y).float().mean().item())'),
    # a function that puts the model in eval mode and back, where it trains
    "evaluate": (EPOCH, 'hs.log("val_acc", evaluate(net))'),
    "evaluate_in_steps": (STEP, 'hs.log("val_acc", evaluate(net))'),
    "guarded_helper": (
        STEP,
        'if epoch == 1:\n    gn = sum(p.grad.norm() ** 2 for p in net.parameters()) ** 0.5\n    hs.log("gn", float(gn))',
    ),
}


@pytest.mark.parametrize("case", list(PROBE_ACCEPTED))
def test_a_harmless_probe_is_accepted_beside_a_refused_one(case: str) -> None:
    """Reading values (`loss.item()`, a weight's norm, the learning rate, a
    model where it is in eval mode, `evaluate(net)` that restores training
    mode) changes nothing: only the drawing probe beside it is refused."""
    after, code = PROBE_ACCEPTED[case]
    alone = analyze(TRAIN, with_added(after, code, TRAIN), "train.py")
    assert alone.compatible, alone.differences
    names = {line.split('"')[1] for line in code.splitlines() if "hs.log(" in line}
    assert {p.name for p in alone.new_probes} == names
    both = with_added(
        "history.append(loss.item())", 'hs.log("noise", torch.randn(1).item())', with_added(after, code, TRAIN)
    )
    a = analyze(TRAIN, both, "train.py")
    reasons = [d for d in a.differences if d.startswith("line ")]
    assert not a.compatible and len(reasons) == 1 and "hs.log('noise', torch.randn(1).item())" in reasons[0], reasons


def test_a_recorded_draw_is_no_difference_a_new_or_moved_one_is_refused() -> None:
    """A recorded hs.log ran when recording too: its draw is part of the
    recorded training. Beside it new probes are judged alone; the same draw
    added elsewhere, or moved, runs at another time and is refused, also
    when the new statements are placed into an older recorded version."""
    draw = 'hs.log("noise", torch.randn(1).item())'
    recorded = with_added(STEP, draw, TRAIN)
    a = analyze(
        recorded, with_added("history.append(loss.item())", 'hs.log("lr", opt.param_groups[0]["lr"])', recorded)
    )
    assert a.compatible and [p.name for p in a.new_probes] == ["lr"]

    again = with_added(EPOCH, draw.replace('"noise"', '"noise2"'), recorded)
    a = analyze(recorded, again, "train.py")
    reasons = [d for d in a.differences if d.startswith("line ")]
    assert not a.compatible
    assert reasons == [
        f"line {line_of(recorded, EPOCH)}: hs.log('noise2', torch.randn(1).item()): calls torch.randn(), which {DRAWS}"
        "; draw from a separate generator seeded with a constant (torch.Generator().manual_seed(0), "
        "np.random.default_rng(0), random.Random(0)) or log a value the script already computes"
    ]

    moved = with_added(EPOCH, draw, TRAIN)
    a = analyze(recorded, moved, "train.py")
    assert not a.compatible and any(
        "hs.log('noise', torch.randn(1).item()): calls torch.randn()" in d for d in a.differences
    )

    # Recorded from an older version: replay places the new statements into
    # that version's source, and the result is judged again.
    older = recorded.replace("lr=0.1", "lr=0.2")
    src, problems = transplant(older, again, "train.py")
    assert problems == [] and src is not None
    placed = analyze(older, src, "train.py")
    assert not placed.compatible and any(
        "hs.log('noise2', torch.randn(1).item()): calls" in d for d in placed.differences
    )


class _Hs:
    """hindsight's `hs` for running a script in this process: logs kept, loops as they are."""

    def __init__(self) -> None:
        self.logged: dict[str, list[object]] = {}

    def log(self, name: str, value: object) -> object:
        self.logged.setdefault(name, []).append(value)
        return value

    def loop(self, name: str, iterable: object) -> object:
        return iterable

    def checkpointing(self, **objects: object) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()


def trained(script: str) -> tuple[list[object], list[float]]:
    """Run `script` (with `hs` stubbed) and return its trained weights and logged losses."""
    hs = _Hs()
    scope: dict[str, object] = {"hs": hs, "__name__": "__main__"}
    exec(compile(script.replace("import hindsight as hs\n", ""), "train.py", "exec"), scope)
    net = scope["net"]
    return [p.detach().clone() for p in net.parameters()], [float(v) for v in hs.logged["loss"]]  # type: ignore[attr-defined]


def test_the_verdict_is_what_the_probe_does_to_the_training() -> None:
    """Ground truth: the training run with each probe, against the run
    without. A refused probe changes the trained weights; an accepted one
    leaves them bit-identical (including `evaluate(net)`, which switches
    the model to eval mode and back)."""
    import torch

    cases = [
        *((*PROBE_ACCEPTED[c], False) for c in ("loss", "weight_norm", "lr", "accuracy", "grad_norm", "seeded_numpy")),
        *((*PROBE_ACCEPTED[c], False) for c in ("seeded_torch", "model_in_eval", "evaluate", "evaluate_in_steps")),
        *((*PROBE_REFUSED[c][:2], True) for c in ("randn", "uniform_", "next_iter", "iter_loader", "model_training")),
        *((*PROBE_REFUSED[c][:2], True) for c in ("model_after_train", "add_")),
    ]
    weights, losses = trained(TRAIN)
    assert (weights, losses) != ([], [])
    for after, code, changes in cases:
        probed = with_added(after, code, TRAIN)
        w, logged = trained(probed)
        same = logged == losses and all(torch.equal(a, b) for a, b in zip(w, weights, strict=True))
        assert same != changes, f"{code}: the training {'did not change' if same else 'changed'}"
        assert analyze(TRAIN, probed, "train.py").compatible == (not changes), code


def test_a_for_over_a_name_bound_to_hs_loop_is_that_loop() -> None:
    """`steps = hs.loop("step", ...) if ... else ...; for b in steps:` (the
    zoo GAN's --count switch): a probe in that `for` runs in the step loop.
    Placed in the epoch loop instead, the replay restored every epoch and
    ran the probe nowhere, exiting 0 with no value."""
    from hindsight._analysis import probes

    src = (
        "import hindsight as hs\n"
        "for epoch in hs.loop('epoch', range(2)):\n"
        "    steps = hs.loop('step', enumerate(range(3))) if epoch >= 0 else enumerate(hs.loop('step', range(3)))\n"
        "    for i, x in steps:\n"
        "        hs.log('x', x)\n"
    )
    found, outer = probes(src)
    assert [(p.name, p.loops) for p in found] == [("x", ("epoch", "step"))]
    assert outer == ["epoch"]


def test_a_method_of_a_class_the_script_defines_is_followed_through_its_instance() -> None:
    """The DDP tutorial's shape: `trainer = Trainer(...); trainer.train(n)`
    runs the loops in a method. Its probes have a place (a probe after the
    inner loop restores, not re-executes), while `model.train()`, torch's
    own method of the same name, is no call into the script."""
    from hindsight._analysis import probes

    src = (
        "import hindsight as hs\n"
        "class Trainer:\n"
        "    def train(self, n):\n"
        "        for epoch in hs.loop('epoch', range(n)):\n"
        "            hs.log('before', 1)\n"
        "            for x in hs.loop('step', range(3)):\n"
        "                hs.log('x', x)\n"
        "            hs.log('after', 2)\n"
        "def main():\n"
        "    model = make()\n"
        "    for _ in range(2):\n"
        "        model.train()\n"
        "    trainer = Trainer()\n"
        "    trainer.train(2)\n"
        "main()\n"
    )
    found, outer = probes(src)
    assert outer == ["epoch"]
    got = {p.name: (p.loops, p.in_function, p.before_inner) for p in found}
    assert got == {
        "before": (("epoch",), False, True),
        "x": (("epoch", "step"), False, False),
        "after": (("epoch",), False, False),
    }
    # Rebound to something else, the name no longer calls the method.
    found, outer = probes(src.replace("    trainer.train(2)\n", "    trainer = other\n    trainer.train(2)\n"))
    assert outer == [] and all(p.in_function for p in found)

"""Which added code replay accepts as observing only (seed 000's side-effect
rules): hs.log, helper variables, `if` guards, imports and prints that write
nothing the training reads. Anything else is refused, naming the statement."""

from __future__ import annotations

import textwrap

import pytest

from hindsight._analysis import analyze

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


def with_added(after: str, code: str) -> str:
    """RECORDED with `code` (indented like `after`) inserted after the line `after`."""
    lines = RECORDED.splitlines(keepends=True)
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
    "random_draw": ("opt.step()", "noise = torch.randn(1)", "draws from a random stream"),
    "python_random": (
        'print("epoch", epoch)',
        "pick = random.random()",
        "draws from a random stream",
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

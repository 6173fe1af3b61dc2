"""Which variables a loop leaves behind that later code reads (issue 41,
item 7): a Hugging Face causal-LM loop assigns `outputs` (a model output no
checkpoint can hold) in its training steps and again in its evaluation loop
before reading it there. That is no read of the steps' value, and recording
must not be refused for it; a real read of it still is."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hindsight._run.loopvars import _changed, _live, _loop_at, _own_nodes

# -- recordings ------------------------------------------------------------------

SCRIPT = """\
import os, signal, threading
import torch
import hindsight as hs


class Output:  # a model output's shape: a loss, and a lock no checkpoint holds
    def __init__(self, loss):
        self.loss, self.lock = loss, threading.Lock()


torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
train = [torch.randn(2, 4) for _ in range(4)]
evals = [torch.randn(2, 4) for _ in range(2)]


def main():
    with hs.checkpointing(model=model, optimizer=optimizer):
        for epoch in hs.loop("epoch", range(3)):
            model.train()
            for step, batch in enumerate(hs.loop("step", train)):
                outputs = Output(model(batch).pow(2).mean())
                loss = outputs.loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                print("step", epoch, step, flush=True)
                if os.environ.get("SIGNAL_AT") == f"{epoch}.{step}" and not os.path.exists("signalled"):
                    open("signalled", "w").close()
                    os.kill(os.getpid(), signal.SIGUSR1)
            model.eval()
            losses = []
            for step, batch in enumerate(evals):
                with torch.no_grad():
                    outputs = Output(model(batch).pow(2).mean())
                loss = outputs.loss
                losses.append(loss.item())
                if os.environ.get("KILL_AT") == str(epoch) and not os.path.exists("killed"):
                    open("killed", "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
            print("eval", epoch, sum(losses) / len(losses), flush=True)


main()
"""

# The same at module level, without a main().
_head, _main = SCRIPT.split("def main():\n")
MODULE_LEVEL = _head + textwrap.dedent(_main.replace("\nmain()\n", "\n"))
assert "def main" not in MODULE_LEVEL and "\n            outputs = Output" in MODULE_LEVEL

# `outputs` read after the steps, before the evaluation loop assigns it again.
READ_AFTER = SCRIPT.replace(
    "            model.eval()\n",
    '            print("last train loss", outputs.loss.item(), flush=True)\n            model.eval()\n',
)


def record(tmp_path: Path, text: str, **extra: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(text)
    env = {**os.environ, "HINDSIGHT_HOME": str(tmp_path / ".hindsight"), "HINDSIGHT_CHECKPOINT_EVERY": "1", **extra}
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )


def checkpoints(stderr: str) -> int:
    m = re.search(r"completed after .*?: (\d+) checkpoints", stderr)
    assert m, stderr[-2000:]
    return int(m.group(1))


@pytest.mark.parametrize("text", [SCRIPT, MODULE_LEVEL], ids=["in_main", "module_level"])
def test_an_evaluation_loop_assigning_outputs_again_before_reading_it_is_no_read_of_the_steps(
    tmp_path: Path, text: str
) -> None:
    r = record(tmp_path, text)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cannot be checkpointed" not in r.stderr
    assert [line.split()[1] for line in r.stdout.splitlines() if line.startswith("eval")] == ["0", "1", "2"]
    assert checkpoints(r.stderr) >= 2  # at least one taken after an evaluation loop reassigned outputs


def evals(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("eval")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    r = record(tmp_path_factory.mktemp("ref"), SCRIPT)
    assert r.returncode == 0, r.stderr[-3000:]
    return evals(r.stdout)


def test_a_resume_between_steps_without_outputs_goes_on_as_the_uninterrupted_run(
    tmp_path: Path, reference: list[str]
) -> None:
    """Signalled in the second epoch's steps, then rerun: the steps left go
    on from the checkpoint (with no `outputs` in it) and every evaluation
    computes what the uninterrupted run did."""
    first = record(tmp_path, SCRIPT, SIGNAL_AT="1.1")
    assert first.returncode == 85, first.stderr[-3000:]
    again = record(tmp_path, SCRIPT, SIGNAL_AT="1.1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continues from checkpoint" in again.stderr, again.stderr[-3000:]
    assert evals(first.stdout + again.stdout) == reference


def test_a_resume_after_the_steps_without_outputs_evaluates_as_the_uninterrupted_run(
    tmp_path: Path, reference: list[str]
) -> None:
    """Killed in the last epoch's evaluation, then rerun: the run goes on
    from a checkpoint taken where an epoch's steps ended, skips them, and its
    evaluation loop (which assigns `outputs` before reading it) computes
    what the uninterrupted run did."""
    first = record(tmp_path, SCRIPT, KILL_AT="2")
    assert first.returncode == -9, first.stderr[-3000:]
    again = record(tmp_path, SCRIPT, KILL_AT="2")
    assert again.returncode == 0, again.stderr[-3000:]
    at = re.search(r"continues from checkpoint \S+\.epoch-(\d+) ", again.stderr)
    if at is None:
        # The kill came before the writer made any checkpoint durable (a
        # loaded machine): the run starts over, as it must.
        assert "continues from the start" in again.stderr, again.stderr[-3000:]
        assert evals(again.stdout) == reference
        return
    epoch = int(at[1])
    assert f"step {epoch} " not in again.stdout  # its steps were skipped
    assert evals(again.stdout) == reference[epoch:]


def test_outputs_read_after_the_steps_is_still_refused_before_the_next_epoch(tmp_path: Path) -> None:
    r = record(tmp_path, READ_AFTER)
    assert r.returncode == 1, r.stderr[-3000:]
    assert re.search(r"UnsupportedTypeError: variable 'outputs' \(line \d+\) is assigned by loop 'step'", r.stderr)
    assert "cannot be checkpointed" in r.stderr and 'transient=["outputs"]' in r.stderr
    # Refused where the first block of steps ends: nothing after it ran.
    assert "last train loss" not in r.stdout and "eval" not in r.stdout and "step 1 " not in r.stdout, r.stdout


def test_outputs_read_after_the_steps_is_refused_after_the_first_step(tmp_path: Path) -> None:
    r = record(tmp_path, READ_AFTER)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "variable 'outputs'" in r.stderr
    assert [line for line in r.stdout.splitlines() if line.startswith("step")] == ["step 0 0"], r.stdout


# -- the analysis ------------------------------------------------------------------


def read_later(src: str, name: str = "outputs", cell: bool = False) -> bool:
    """Whether `name`, changed by the loop whose header says `# steps`, is
    read later (LoopVars.live) in the function holding it, else the module."""
    src = textwrap.dedent(src)
    tree = ast.parse(src)
    line = next(i for i, text in enumerate(src.splitlines(), 1) if "# steps" in text)
    scope: ast.AST = tree
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.lineno < line <= (node.end_lineno or 0):
            if any(isinstance(n, ast.For) and n.lineno == line for n in _own_nodes(node)):
                scope = node
    loop = _loop_at(scope, line)
    assert loop is not None and loop.lineno == line
    names, _, into = _changed(loop)
    assert name in names
    assigned = {n for n, line in names.items() if line > 0} - into
    return name in _live(scope, loop, into, assigned, cell=cell)


HF = """
for epoch in hs.loop("epoch", range(3)):
    model.train()
    for step, batch in enumerate(hs.loop("step", train)):  # steps
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
    model.eval()
    losses = []
    for step, batch in enumerate(eval_dataloader):
        with torch.no_grad():
            outputs = model(**batch)
        loss = outputs.loss
        losses.append(loss)
    print(sum(losses))
"""


def after_steps(code: str, before_loop: str = "", after_loop: str = "") -> str:
    """A two-level loop with `code` after the steps, in the epoch."""
    body = textwrap.indent(textwrap.dedent(code), "    ")
    return f"{before_loop}\nfor epoch in hs.loop('epoch', range(3)):\n    for b in hs.loop('step', data):  # steps\n        outputs = f(b)\n{body}\n{after_loop}"


NOT_READ = {
    "hf_eval_loop": HF,
    "hf_eval_loop_in_a_function": "def main():\n" + textwrap.indent(HF, "    ") + "\n    return losses\n",
    "assigned_then_read": after_steps("outputs = g()\nprint(outputs)"),
    "both_branches_assign": after_steps("if c:\n    outputs = g()\nelse:\n    outputs = h()\nprint(outputs)"),
    "try_and_handler_assign": after_steps(
        "try:\n    outputs = g()\nexcept ValueError:\n    outputs = None\nprint(outputs)"
    ),
    "walrus": after_steps("if (outputs := g()) is not None:\n    print(outputs)\nprint(outputs)"),
    "with_as": after_steps("with open(p) as outputs:\n    print(outputs.read())"),
    "for_target_read_in_its_body": after_steps("for outputs in xs:\n    print(outputs)"),
    "a_function_with_its_own_outputs": after_steps(
        "outputs = g()", before_loop="def evaluate(m):\n    outputs = m(x)\n    return outputs.loss\n"
    ),
    "a_lambda_parameter_of_that_name": after_steps("key = lambda outputs: outputs.loss"),
    "read_after_the_epochs_once_assigned": after_steps("outputs = g()", after_loop="print(outputs)"),
    "break_then_assigned_after": after_steps("if done:\n    break", after_loop="outputs = None\nprint(outputs)"),
    "vars_of_an_object": after_steps("outputs = g()\nprint(vars(args))"),
}

READ = {
    "read_after_the_steps": after_steps("print(outputs.loss)\noutputs = g()"),
    "read_by_the_steps_else": after_steps("outputs = g()").replace(
        "        outputs = f(b)\n", "        outputs = f(b)\n    else:\n        print(outputs)\n"
    ),
    "only_one_branch_assigns": after_steps("if c:\n    outputs = g()\nprint(outputs)"),
    "eval_loop_may_run_no_batch": after_steps("for b in evals:\n    outputs = g(b)\nprint(outputs)"),
    "for_target_may_not_be_assigned": after_steps("for outputs in xs:\n    pass\nprint(outputs)"),
    "next_epoch_reads_it_before_the_steps": after_steps("pass").replace(
        "    for b in hs.loop", "    print(outputs)\n    for b in hs.loop"
    ),
    # A resume re-runs the code before the steps from the values the epoch
    # began with: there, `outputs` is the last epoch's g(), and no checkpoint holds it.
    "next_epoch_reads_the_value_after_the_steps": after_steps("outputs = g()").replace(
        "    for b in hs.loop", "    print(outputs)\n    for b in hs.loop"
    ),
    "continue_skips_the_assignment": after_steps("if c:\n    continue\noutputs = g()").replace(
        "    for b in hs.loop", "    print(outputs)\n    for b in hs.loop"
    ),
    "break_skips_the_assignment": after_steps("if c:\n    break\noutputs = g()", after_loop="print(outputs)"),
    "augmented_assignment": after_steps("outputs += g()"),
    "del": after_steps("del outputs"),
    "attribute_store": after_steps("outputs.loss = None\noutputs = g()"),
    "handler_after_a_failed_assignment": after_steps(
        "try:\n    outputs = g()\nexcept ValueError:\n    pass\nprint(outputs)"
    ),
    "handler_reads": after_steps("try:\n    risky()\n    outputs = g()\nexcept ValueError:\n    print(outputs)"),
    "finally_reads": after_steps("try:\n    risky()\n    outputs = g()\nfinally:\n    print(outputs)"),
    "suppressing_with": after_steps("with contextlib.suppress(ValueError):\n    outputs = g()\nprint(outputs)"),
    "unknown_context_manager": after_steps("with my_context():\n    outputs = g()\nprint(outputs)"),
    "walrus_under_and": after_steps("if c and (outputs := g()):\n    pass\nprint(outputs)"),
    "walrus_in_a_comprehension": after_steps("ys = [(outputs := y) for y in xs]\nprint(outputs)"),
    "a_closure": after_steps("outputs = g()", before_loop="def show():\n    return outputs.loss\n"),
    "a_lambda": after_steps("outputs = g()", before_loop="show = lambda: outputs.loss\n"),
    "a_generator_expression": after_steps("outputs = g()\ngen = (outputs.loss for _ in range(2))"),
    "a_class_body": after_steps("outputs = g()\nclass Report:\n    loss = outputs.loss"),
    # Where every variable can be read, one read elsewhere is read later.
    "locals": after_steps("outputs = g()\nprint(outputs, locals())"),
    "exec": after_steps("exec(code)\noutputs = g()\nprint(outputs)"),
    "match_capture": after_steps("match x:\n    case [outputs]:\n        pass\nprint(outputs)"),
}

IN_FUNCTION_READ = {
    "global": "def main():\n    global outputs\n    for b in hs.loop('step', data):  # steps\n        outputs = f(b)\n"
    "    outputs = g()\n    print(outputs)\n",
    "closure": "def main():\n    for b in hs.loop('step', data):  # steps\n        outputs = f(b)\n"
    "    outputs = g()\n    def show():\n        return outputs\n    return show\n",
    "return_through_finally": "def main():\n    try:\n        for b in hs.loop('step', data):  # steps\n"
    "            outputs = f(b)\n        return 1\n    finally:\n        print(outputs)\n",
}


@pytest.mark.parametrize("src", NOT_READ.values(), ids=NOT_READ.keys())
def test_assigned_again_before_any_read_is_not_read_later(src: str) -> None:
    assert not read_later(src), src


@pytest.mark.parametrize("src", [*READ.values(), *IN_FUNCTION_READ.values()], ids=[*READ, *IN_FUNCTION_READ])
def test_a_way_to_a_read_before_an_assignment_is_read_later(src: str) -> None:
    assert read_later(src), src


def test_a_notebook_cell_leaves_its_variables_to_later_cells() -> None:
    assert not read_later(HF)
    assert read_later(HF, cell=True)


def test_an_object_the_loop_changes_in_place_is_read_later_wherever_it_is_read() -> None:
    """`history` may be read through another name after it is assigned again."""
    src = after_steps("history = []\nprint(history)").replace("        outputs = f(b)\n", "        history.append(b)\n")
    assert read_later(src, "history")
    src = after_steps("stats = {}\nprint(stats)").replace("        outputs = f(b)\n", "        stats['n'] = b\n")
    assert read_later(src, "stats")


def test_an_outer_loops_variable_read_after_it_is_still_read_later() -> None:
    src = "for epoch in hs.loop('epoch', range(3)):  # steps\n    report = io.StringIO()\nprint(report)\n"
    assert read_later(src, "report")
    assert not read_later(src.replace("print(report)", "report = None\nprint(report)"), "report")


def test_a_replay_probe_reading_outputs_after_skipped_steps_is_refused_not_given_an_older_value(
    tmp_path: Path,
) -> None:
    """The recording kept no `outputs` (nothing read it after the steps). A
    probe added there, even only in the last epoch, would read the value the
    previous epoch's evaluation loop left, the steps being skipped: refused,
    naming the variable."""
    r = record(tmp_path, SCRIPT)
    assert r.returncode == 0, r.stderr[-3000:]
    probe = (
        '            if epoch == 2:\n                hs.log("last", outputs.loss.item())\n            model.eval()\n'
    )
    (tmp_path / "train.py").write_text(SCRIPT.replace("            model.eval()\n", probe))
    rep = subprocess.run(
        [sys.executable, "-m", "hindsight", "replay", "train.py", "-q"],
        env={**os.environ, "HINDSIGHT_HOME": str(tmp_path / ".hindsight")},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert rep.returncode != 0, rep.stdout + rep.stderr
    assert "reads 'outputs' (line" in rep.stderr and "did not keep its value" in rep.stderr, rep.stderr[-3000:]
    q = subprocess.run(
        [sys.executable, "-c", "import hindsight as hs; print(len(hs.dataframe('last')))"],
        env={**os.environ, "HINDSIGHT_HOME": str(tmp_path / ".hindsight")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "never logged 'last'" in q.stderr or q.stdout.strip() == "0", q.stdout + q.stderr

"""Jupyter notebooks, executed by a real ipykernel (nbclient): the notebook is
the run's script, its directory the project, its cells the recorded source;
running it again resumes as a script run again does; `hindsight replay
x.ipynb` runs its code cells as a script."""

from __future__ import annotations

import json
import os
import subprocess
import sysconfig
from pathlib import Path

import pytest

from hindsight import _native
from hindsight._run import jupyter
from hindsight.errors import ReplayError

from conftest import hindsight_cmd

# requirements-dev.txt has them; a lent GPU machine's image may not (its
# `pytest -m cuda` collects this file too).
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

SETUP = """\
import os
import torch
import hindsight as hs

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.randn(16, 4)
target = data.sum(1, keepdim=True)
"""

MAGICS = "%load_ext autoreload\n%autoreload 2"

TRAIN = """\
seen = 0  # a loop variable: checkpointed with the model, found in the cell's source
with hs.checkpointing(model=model, opt=opt, every=1):
    for epoch in hs.loop("epoch", range(4)):
        for step in hs.loop("step", range(3)):
            loss = ((model(data) - target) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += 1
            if epoch == 2 and step == 1 and os.path.exists("stop.flag"):
                os.remove("stop.flag")
                raise KeyboardInterrupt  # the kernel's stop button
        hs.log("loss", loss.item())
        hs.log("seen", seen)
        hs.log("wnorm", model.weight.norm().item())
print("RUN", hs.run_id())
"""

# Added after the recording: the values a replay computes from the checkpoints.
PROBE = '        hs.log("probe", [loss.item(), model.weight.norm().item()])\n'

READ = 'print("DF", hs.dataframe("loss")["loss"].tolist())'


def notebook(path: Path, train: str = TRAIN, extra: tuple[str, ...] = ()) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# A tiny model\nMarkdown is no code."),
        nbformat.v4.new_code_cell(SETUP),
        nbformat.v4.new_code_cell(MAGICS),
        nbformat.v4.new_code_cell(train),
        nbformat.v4.new_code_cell(READ),
        *[nbformat.v4.new_code_cell(c) for c in extra],
    ]
    nbformat.write(nb, path)
    return path


def execute(path: Path, session: bool = True, allow_errors: bool = False) -> list[str]:
    """Run every cell of the notebook in a fresh kernel, as Jupyter's "Restart
    and run all" does; each cell's text output (streams and errors)."""
    nb = nbformat.read(path, as_version=4)
    env = {k: v for k, v in os.environ.items() if k != "JPY_SESSION_NAME"}
    if session:  # what jupyter_server >= 2 sets for the kernel of a notebook
        env["JPY_SESSION_NAME"] = str(path)
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=50,
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute(env=env)
    out = []
    for cell in nb.cells:
        text = ""
        for o in cell.get("outputs", []):
            if o["output_type"] == "stream":
                text += o["text"]
            elif o["output_type"] == "error":
                text += f"{o['ename']}: {o['evalue']}\n"
        out.append(text)
    return out


def df_values(out: list[str]) -> list[float]:
    line = next(line for line in out[4].splitlines() if line.startswith("DF "))
    return [float(v) for v in json.loads(line[3:])]


def runs(home: Path) -> list[_native.RunInfo]:
    return list(_native.LogDb(str(home / "logs.db")).runs())


def logs(cwd: Path, name: str) -> dict[int, tuple[float, bool]]:
    """{epoch: (value, written by a replay)} of the latest run, as `hindsight logs` shows them."""
    r = subprocess.run(
        [*hindsight_cmd(), "logs", name, "--phase", "all", "--json"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return {
        row["ctx"]["epoch"]: (row["values"][name], row["replayed"][name])
        for row in json.loads(r.stdout)
        if name in row["values"]
    }


def test_notebook_is_the_script_and_its_directory_the_project(tmp_path: Path) -> None:
    site = Path(sysconfig.get_paths()["purelib"]) / ".hindsight"
    before = site.exists()
    # The training cell run a second time in the same kernel (after its loop ended) is refused.
    nb = notebook(tmp_path / "train.ipynb", extra=(TRAIN,))
    out = execute(nb, allow_errors=True)
    assert "RUN " in out[3], out
    assert "already ran its outer loop 'epoch' in this kernel" in out[5], out[5]
    values = df_values(out)  # hs.dataframe inside the kernel: this run's values
    assert len(values) == 4 and values[-1] < values[0]
    assert (tmp_path / ".hindsight" / "logs.db").exists()
    assert site.exists() == before, "the project home must never be in site-packages"
    (run,) = runs(tmp_path / ".hindsight")
    assert run.script == "train.ipynb"
    assert run.status == "completed"
    # The recorded source is the notebook's code as a script: magics dropped, markdown left out.
    source = _native.LogDb(str(tmp_path / ".hindsight" / "logs.db")).get_source(run.source_hash)["train.ipynb"]
    assert 'hs.loop("epoch"' in source and "pass  # %autoreload 2" in source
    assert "Markdown is no code" not in source
    # The cells ran in the notebook's order: the source is the notebook as `hindsight replay` reads it.
    assert source == jupyter.script_of(nb)
    assert logs(tmp_path, "loss") == {i: (v, False) for i, v in enumerate(values)}
    # Another notebook's kernel in the same directory reads the same project.
    read = tmp_path / "read.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import hindsight as hs\n" + READ)]), read)
    assert execute(read)[0].strip() == f"DF {json.dumps(values)}"


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The losses of the notebook run once, never stopped."""
    return df_values(execute(notebook(tmp_path_factory.mktemp("ref") / "train.ipynb")))


def test_stopped_notebook_resumes_when_run_again(tmp_path: Path, expected: list[float]) -> None:

    nb = notebook(tmp_path / "train.ipynb")
    (tmp_path / "stop.flag").touch()
    out = execute(nb, allow_errors=True)
    assert "KeyboardInterrupt" in out[3]
    (run,) = runs(tmp_path / ".hindsight")
    assert run.status == "interrupted"  # as a script stopped by Ctrl-C
    # A kernel that runs only the first cells (no training) leaves it interrupted.
    setup_only = nbformat.read(nb, as_version=4)
    setup_only.cells = [nbformat.v4.new_code_cell(SETUP + 'lr = hs.arg("lr", 0.05)')]
    nbformat.write(setup_only, nb)
    assert f"resuming run {run.id}" in execute(nb)[0]
    assert [r.status for r in runs(tmp_path / ".hindsight")] == ["interrupted"]
    notebook(nb)
    # Restart the kernel and run all: the same run goes on from its checkpoint.
    out = execute(nb)
    assert f"hindsight: resuming run {run.id}" in out[1] + out[3]
    assert f"RUN {run.id}" in out[3]
    assert df_values(out) == expected  # exactly the values of a run never stopped
    assert logs(tmp_path, "seen") == {0: (3, False), 1: (6, False), 2: (9, False), 3: (12, False)}
    (again,) = runs(tmp_path / ".hindsight")
    assert again.status == "completed"


def test_stopped_training_cell_run_again_in_the_same_kernel_resumes(tmp_path: Path, expected: list[float]) -> None:
    nb = notebook(tmp_path / "train.ipynb", extra=(TRAIN, READ))
    (tmp_path / "stop.flag").touch()
    out = execute(nb, allow_errors=True)
    assert "KeyboardInterrupt" in out[3]
    assert "resuming run" in out[5]
    line = next(line for line in out[6].splitlines() if line.startswith("DF "))
    assert json.loads(line[3:]) == expected
    assert [r.status for r in runs(tmp_path / ".hindsight")] == ["completed"]
    # A completed notebook run again is a new run, as a script run twice is.
    out = execute(notebook(nb))
    assert "resuming" not in "".join(out)
    assert df_values(out) == expected
    assert [r.status for r in runs(tmp_path / ".hindsight")] == ["completed", "completed"]


def test_replay_of_a_notebook_computes_new_log_statements(tmp_path: Path) -> None:
    nb = notebook(tmp_path / "train.ipynb")
    execute(nb)
    probed = TRAIN.replace('        hs.log("loss", loss.item())\n', '        hs.log("loss", loss.item())\n' + PROBE)
    notebook(nb, probed)  # the user adds a hs.log line to the training cell
    r = subprocess.run([*hindsight_cmd(), "replay", str(nb)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nothing to compute" not in r.stdout
    # Each value is what the recording saw there (its loss and weights), written by the replay.
    loss, wnorm = logs(tmp_path, "loss"), logs(tmp_path, "wnorm")
    assert logs(tmp_path, "probe") == {i: ([loss[i][0], wnorm[i][0]], True) for i in range(4)}
    assert not list(tmp_path.glob(".hindsight-replay-*")), "the converted script is removed"

    # A shell escape cannot run as a script: refused, naming the cell and the line.
    notebook(nb, probed, extra=("x = 1\n!echo hi",))
    r = subprocess.run([*hindsight_cmd(), "replay", str(nb)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "train.ipynb, cell 6, line 2: '!echo hi'" in r.stderr, r.stderr


def test_a_kernel_that_does_not_say_its_notebook_is_refused_until_named(tmp_path: Path) -> None:
    # `%run script.py` in that kernel records the script, as `python script.py` would.
    (tmp_path / "script.py").write_text(
        "import hindsight as hs\nfor i in hs.loop('i', range(2)):\n    hs.log('x', i)\nprint('SCRIPT', hs.run_id())\n"
    )
    nb = notebook(tmp_path / "train.ipynb", extra=("%run script.py",))
    out = execute(nb, session=False, allow_errors=True)
    assert "hs.notebook('NAME.ipynb')" in out[3], out
    assert "SCRIPT " in out[5], out
    assert [r.script for r in runs(tmp_path / ".hindsight")] == ["script.py"]
    named = nbformat.read(nb, as_version=4)
    named.cells[1].source = SETUP + 'hs.notebook("train.ipynb")\n'
    named.cells = named.cells[:5]
    nbformat.write(named, nb)
    out = execute(nb, session=False)
    assert "RUN " in out[3]
    assert sorted(r.script for r in runs(tmp_path / ".hindsight")) == ["script.py", "train.ipynb"]


def test_magics_that_change_no_value_are_dropped(tmp_path: Path) -> None:
    nb = notebook(
        tmp_path / "train.ipynb", extra=("%%time\nx = 1", "%matplotlib inline\nif True:\n    %autoreload 2\ny = 2")
    )
    script = jupyter.script_of(nb)
    ns: dict[str, object] = {}
    exec(compile(script.split("# %% cell 6")[1], "cells", "exec"), ns)  # the added cells, as Python
    assert (ns["x"], ns["y"]) == (1, 2)
    assert "pass  # %%time" in script and "    pass  # %autoreload 2" in script


@pytest.mark.parametrize("magic", ["%cd /tmp", "%%bash\necho hi", "files = !ls"])
def test_untranslatable_magics_are_refused_by_name(tmp_path: Path, magic: str) -> None:
    nb = notebook(tmp_path / "train.ipynb", extra=(magic,))
    with pytest.raises(ReplayError, match=r"train\.ipynb, cell 6, line 1: "):
        jupyter.script_of(nb)


def test_record_refuses_a_notebook_file(tmp_path: Path) -> None:
    nb = notebook(tmp_path / "train.ipynb")
    r = subprocess.run([*hindsight_cmd(), "record", str(nb)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "is a notebook: run it in Jupyter" in r.stderr
    assert not (tmp_path / ".hindsight").exists()

"""hindsight.lightning under several ranks: a Lightning DDP fit (CPU, gloo,
Lightning's own launcher). A stop signal to one rank stops every rank at
the same step, through the ranks' one agreement (`_run.ranks`, as an
hs.loop recording's ranks agree), under the signal's own number; with a
loader Lightning can resume (state_dict/load_state_dict), the relaunch
resumes mid-epoch to the weights of an uninterrupted fit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("lightning")

# Two ranks on 2 cores: alone, and launched afresh (as test_ranks.py).
pytestmark = [pytest.mark.serial, pytest.mark.fresh_process, pytest.mark.timeout(600)]

SCRIPT = """
import os, signal, sys, time
import torch
import lightning.pytorch as pl
from hindsight.lightning import HindsightCheckpoint

store = sys.argv[1]
stop_at, flag = os.environ.get("STOP_AT"), os.environ.get("FLAG", "")
WORLD = 2


class Shards:
    # Each rank's batches of a per-epoch shuffle, resumable at any batch
    # (Lightning saves and restores a loader with state_dict/load_state_dict).

    def __init__(self, x, y, batch):
        self.x, self.y, self.batch = x, y, batch
        self.rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.epoch, self.pos, self.start = 0, 0, 0

    def __len__(self):
        return len(self.x) // (self.batch * WORLD)

    def __iter__(self):
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.epoch))[self.rank::WORLD]
        start, self.start = self.start, 0
        for i in range(start, len(self)):
            idx = order[i * self.batch:(i + 1) * self.batch]
            self.pos = i + 1
            yield self.x[idx], self.y[idx]
        self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self.epoch, self.start = state["epoch"], state["pos"]


class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if stop_at == f"{self.trainer.global_rank}:{self.global_step}" and not os.path.exists(flag):
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.02)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


pl.seed_everything(0, verbose=False)
g = torch.Generator().manual_seed(0)
data = Shards(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g), batch=4)
trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy="ddp", max_epochs=3, enable_progress_bar=False,
                     logger=False, enable_checkpointing=False, enable_model_summary=False, use_distributed_sampler=False,
                     default_root_dir=sys.argv[2], callbacks=[HindsightCheckpoint(store, keep_last=2)])
trainer.fit(M(), data, ckpt_path=HindsightCheckpoint.latest_path(store))
if trainer.is_global_zero:
    w = trainer.lightning_module.net.weight.detach().flatten().tolist()
    print("final", trainer.current_epoch, trainer.global_step, repr(w), flush=True)
"""


def fit(d: Path, **env: str) -> subprocess.CompletedProcess[str]:
    d.mkdir(exist_ok=True)
    (d / "train.py").write_text(textwrap.dedent(SCRIPT))
    cmd = [sys.executable, "train.py"]
    e = {**os.environ, "OMP_NUM_THREADS": "1", "HINDSIGHT_HOME": str(d / ".hindsight"), **env}
    return subprocess.run([*cmd, str(d / "store"), str(d)], cwd=d, env=e, capture_output=True, text=True, timeout=300)


def final(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, r.stderr[-4000:]
    return next(line for line in r.stdout.splitlines() if line.startswith("final"))


def test_a_signal_to_one_rank_of_a_ddp_fit_stops_both_and_the_relaunch_resumes_exactly(tmp_path: Path) -> None:
    import hindsight as hs

    want = final(fit(tmp_path / "ref"))
    assert want.startswith("final 3 24 ")  # 3 epochs of 8 steps a rank
    job = tmp_path / "job"
    stopped = fit(job, STOP_AT="1:11", FLAG=str(tmp_path / "flag"))
    assert stopped.returncode == 85, stopped.stderr[-4000:]
    # Rank 0 speaks for the job, under the signal rank 1 got.
    assert "hindsight: SIGUSR1: checkpointed lightning.epoch-000001.step-" in stopped.stderr, stopped.stderr[-4000:]
    mid = [n for n in hs.Store(job / "store").list() if ".step-" in n]
    assert len(mid) == 1 and mid[0].startswith("lightning.epoch-000001.step-"), mid
    assert 12 <= int(mid[0].rsplit("-", 1)[1]) < 16
    assert final(fit(job)) == want

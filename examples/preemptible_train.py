"""A training script that survives preemption with no extra code.

Send SIGTERM or SIGUSR1: it finishes the current step, writes a durable
checkpoint and exits with 85. Run the same command again: it resumes at the
next step, with the same data order, and ends bit-identical to a run that
was never interrupted.

    python examples/preemptible_train.py --epochs 4 --out final.pt
"""

import os
import time

import torch
from torch import nn

import hindsight as hs

epochs = hs.arg("epochs", 4)
steps_delay = hs.arg("delay", 0.0)  # seconds per step, to make interruption easy to test
out = hs.arg("out", "")

torch.manual_seed(0)
g = torch.Generator().manual_seed(7)
x_all = torch.randn(640, 16, generator=g)
y_all = (x_all.sum(dim=1) > 0).long()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_all, y_all), batch_size=32, shuffle=True)
net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)

with hs.checkpointing(
    model=net,
    optimizer=opt,
    scheduler=sched,
    every=1,
    keep_last=2,
    keep_best=1,
    best_metric="val_loss",
    best_mode="min",
):
    for epoch in hs.loop("epoch", range(epochs)):
        for x, y in hs.loop("step", loader):
            loss = nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            hs.log("loss", loss.item())
            hs.log("first_index_sum", float(x[0].sum()))  # proves the data order
            print(f"step {epoch} {loss.item():.6f}", flush=True)
            if steps_delay:
                time.sleep(steps_delay)
        sched.step()
        with torch.no_grad():
            hs.log("val_loss", nn.functional.cross_entropy(net(x_all[:128]), y_all[:128]).item())

if out:
    torch.save(net.state_dict(), out)
    print("done", os.getpid(), flush=True)

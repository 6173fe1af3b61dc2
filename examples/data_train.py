"""Training fed by the input service: every example once per epoch, in an
order fixed by the seed, whatever happens to the worker processes, and a
preempted run (SIGTERM/SIGUSR1: exit 85; run again) resumes at the exact
next batch, bit-identical to a run never interrupted.

    python examples/data_train.py --epochs 3 --workers local:2 --out final.pt
"""

import time

import torch
from torch import nn

import hindsight as hs
import toy_data

epochs = hs.arg("epochs", 3)
workers = hs.arg("workers", "local:2")
delay = hs.arg("delay", 0.0)  # seconds per step, to make interruption easy to test
out = hs.arg("out", "")

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))
opt = torch.optim.Adam(net.parameters(), lr=1e-2)
loader = hs.data.Loader(toy_data.make, batch_size=32, seed=0, workers=workers, dataset_args={"n": 640})

with loader, hs.checkpointing(model=net, optimizer=opt, every=1, keep_last=2):
    for epoch in hs.loop("epoch", range(epochs)):
        loader.set_epoch(epoch)
        for x, y in hs.loop("step", loader):
            loss = nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            hs.log("loss", loss.item())
            print(f"step {epoch} {loss.item():.6f}", flush=True)
            if delay:
                time.sleep(delay)

if out:
    torch.save(net.state_dict(), out)

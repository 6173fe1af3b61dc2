"""A real training run recorded with hindsight (see README: `make example`).

Add `hs.log(...)` statements later and run `hindsight replay examples/train.py`
to compute their values without re-training.
"""

import torch
from torch import nn

import hindsight as hs

lr = hs.arg("lr", 1e-2)
epochs = hs.arg("epochs", 8)
batches = hs.arg("batches", 16)
seed = hs.arg("seed", 0)
width = hs.arg("width", 64)  # hidden units
depth = hs.arg("depth", 0)  # extra hidden layers of width x width

torch.manual_seed(seed)
g = torch.Generator().manual_seed(1234)
x_all = torch.randn(batches * 32, 20, generator=g)
w_true = torch.randn(20, 4, generator=g)
y_all = (x_all @ w_true).argmax(dim=1)
data = torch.utils.data.TensorDataset(x_all, y_all)
loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
val_x, val_y = x_all[:64], y_all[:64]

hidden = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
net = nn.Sequential(nn.Linear(20, width), nn.ReLU(), nn.Dropout(0.1), *hidden, nn.Linear(width, 4))
opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def evaluate(model: nn.Module) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(val_x).argmax(dim=1) == val_y).float().mean().item()
    model.train()
    return acc


with hs.checkpointing(model=net, optimizer=opt, scheduler=sched):
    for epoch in hs.loop("epoch", range(epochs)):
        for x, y in hs.loop("step", loader):
            loss = nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            hs.log("loss", loss.item())
        sched.step()
        hs.log("val_acc", evaluate(net))

# The IterableDataset of PyTorch's documentation (torch/utils/data/dataset.py,
# IterableDataset docstring, "Example 1: splitting workload across all workers
# in __iter__"; https://github.com/pytorch/pytorch/blob/fff02e67db383726d3ea2b7cfc79ebb7489a0d54/torch/utils/data/dataset.py,
# BSD-3-Clause), grown into the usual streaming-training shape: each worker
# takes its share of [start, end), shuffles it with a generator seeded from
# torch.initial_seed() (in a worker: the base seed the DataLoader draws from
# the main process's RNG when the epoch's iterator is created, plus the worker
# id), and yields examples computed from their index; DataLoader(num_workers=2)
# interleaves the workers' batches; an MLP trained with Adam and a
# ReduceLROnPlateau scheduler stepped on the validation loss.
# Written for the zoo (no single upstream training script has this shape):
# hindsight (hs.arg, hs.checkpointing, hs.loop, hs.log), the zoo test hook.
import math

import torch
import torch.nn as nn

import hindsight as hs
import zoo_hook


class MyIterableDataset(torch.utils.data.IterableDataset):
    def __init__(self, start, end):
        super(MyIterableDataset).__init__()
        assert end > start, "this example code only works with end >= start"
        self.start = start
        self.end = end

    def __iter__(self):
        worker_info = torch.utils.data.get_worker_info()
        if worker_info is None:  # single-process data loading, return the full iterator
            iter_start = self.start
            iter_end = self.end
        else:  # in a worker process
            # split workload
            per_worker = int(math.ceil((self.end - self.start) / float(worker_info.num_workers)))
            worker_id = worker_info.id
            iter_start = self.start + worker_id * per_worker
            iter_end = min(iter_start + per_worker, self.end)
        g = torch.Generator().manual_seed(torch.initial_seed() % 2**62)
        order = torch.randperm(iter_end - iter_start, generator=g) + iter_start
        for i in order.tolist():
            yield self.example(i)

    @staticmethod
    def example(i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(12, generator=g)
        y = torch.tanh(x[:6].sum(0, keepdim=True)) + 0.1 * x[6:7]
        return x, y


epochs = hs.arg("epochs", 3)
examples = hs.arg("examples", 320)
batch_size = hs.arg("batch_size", 16)
workers = hs.arg("workers", 2)
lr = hs.arg("lr", 3e-3)

torch.manual_seed(0)
train_loader = torch.utils.data.DataLoader(MyIterableDataset(0, examples), batch_size=batch_size,
                                           num_workers=workers)
val_x, val_y = map(torch.stack, zip(*[MyIterableDataset.example(10**6 + i) for i in range(128)]))

model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=lr)
scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)

with hs.checkpointing(model=model, optimizer=optimizer, scheduler=scheduler):
    for epoch in hs.loop("epoch", range(epochs)):
        model.train()
        for step, (x, y) in enumerate(hs.loop("step", train_loader)):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            # zoo: step-probe: x.sum().item()
            optimizer.step()
            hs.log("loss", loss.item())
            hs.log("batch_sum", y.sum().item())  # the data order
            zoo_hook.step(epoch, step)
        model.eval()
        with torch.no_grad():
            val_loss = nn.functional.mse_loss(model(val_x), val_y).item()
        scheduler.step(val_loss)
        print(f"epoch {epoch}: val_loss {val_loss:.5f} lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)
        hs.log("val_loss", val_loss)
        # zoo: epoch-probe: sum(p.norm().item() for p in model.parameters())

zoo_hook.final(model=model, optimizer=optimizer, scheduler=scheduler)

# Adapted from pytorch/examples, distributed/ddp-tutorial-series/multigpu_torchrun.py
# (https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/distributed/ddp-tutorial-series/multigpu_torchrun.py, BSD-3-Clause).
# Shape kept: the Trainer class, DDP, DistributedSampler with set_epoch, a snapshot
# every save_every epochs that the next launch resumes from, positional argparse.
# Changed for the zoo: gloo on CPU (no LOCAL_RANK device), MyTrainDataset inline and
# seeded, snapshots through hindsight.dist (every rank saves its part; loading on any
# world size), hsd.StopOnSignal at each batch (a signal to any rank stops all at the
# same batch; the snapshot keeps the batch, skipped on resume), a 20 ms sleep per
# batch so a test can interrupt it, the final weights printed by rank 0.
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DataLoader
from torch.utils.data import Dataset as _Dataset


class MyTrainDataset(_Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group, get_rank
import os, time
import hindsight as hs
import hindsight.dist as hsd


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, store):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.batch = 0
        self.store = store
        self.model = DDP(self.model)
        names = sorted(store.list(), key=lambda n: tuple(int(x) for x in n.split("-")[1:]))
        if names:
            print("Loading snapshot", names[-1])
            got = hsd.load(store, names[-1], self.state())
            self.model.load_state_dict(got.state["model"])
            self.optimizer.load_state_dict(got.state["optim"])
            self.epochs_run, self.batch = got.state["epoch"], got.state["batch"]
            print(f"Resuming training from snapshot at Epoch {self.epochs_run} batch {self.batch}")

    def state(self):
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(), "epoch": self.epochs_run, "batch": self.batch}

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()

    def train(self, max_epochs: int):
        with hsd.StopOnSignal() as stop:
            for epoch in range(self.epochs_run, max_epochs):
                self.epochs_run = epoch
                self.train_data.sampler.set_epoch(epoch)
                skip, self.batch = self.batch, 0
                for i, (source, targets) in enumerate(self.train_data):
                    if i < skip:
                        continue
                    self.batch = i
                    if stop.agreed():
                        name = f"snap-{epoch}-{i}"
                        hsd.save(self.store, name, self.state()).wait()
                        stop.leave(name)
                    self._run_batch(source, targets)
                    time.sleep(0.02)
                self.batch = 0
                if epoch % self.save_every == 0:
                    self.epochs_run = epoch + 1
                    hsd.save(self.store, f"snap-{epoch + 1}-0", self.state())


def load_train_objs():
    torch.manual_seed(0)
    train_set = MyTrainDataset(2048)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False, sampler=DistributedSampler(dataset))


def main(save_every, total_epochs, batch_size, store):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, hs.Store(store))
    trainer.train(total_epochs)
    hsd.save(trainer.store, "final-0-0", trainer.state()).wait()
    if get_rank() == 0:
        print("FINAL", trainer.model.module.weight.sum().item(), trainer.model.module.bias.item())
    destroy_process_group()


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description='simple distributed training job')
    parser.add_argument('total_epochs', type=int)
    parser.add_argument('save_every', type=int)
    parser.add_argument('--batch_size', default=32, type=int)
    parser.add_argument('--store', default="snapshots")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.store)

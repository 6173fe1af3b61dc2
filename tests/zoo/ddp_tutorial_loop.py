# Adapted from pytorch/examples, distributed/ddp-tutorial-series/multigpu_torchrun.py
# (https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/distributed/ddp-tutorial-series/multigpu_torchrun.py, BSD-3-Clause).
# Shape kept: the Trainer class, DDP, DistributedSampler with set_epoch, positional
# argparse, torchrun. Changed as the README tells users: the loops are hs.loop, the
# model and optimizer are given to hs.checkpointing (its own snapshot code goes: a
# relaunch resumes the job's one run), the loss is logged (rank 0's, and every rank's). For the zoo: gloo on CPU
# (no LOCAL_RANK device), MyTrainDataset inline and seeded, dropout (each rank draws
# its own stream), a 20 ms sleep per batch so a test can interrupt it, the final
# weights printed by rank 0, ZOO_CRASH_EPOCH=n: rank 1 crashes in epoch n (not after a restart),
# ZOO_RANK1_SEED=s: rank 1's sampler shuffles with seed s (its data order changed),
# ZOO_RANK1_SCALE=x: rank 1 scales its loss by x (it computes otherwise),
# ZOO_HANG_EPOCH=n: rank 1 hangs in epoch n (not after a restart),
# ZOO_ACCUM=k: gradients accumulate over k batches, synchronised on the last (build-nanogpt's way),
# ZOO_DEVICE=cuda: the model and the batches on the GPU of LOCAL_RANK (modulo the
# GPUs there: ranks may share one; gloo carries CUDA tensors).
import os
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, get_rank, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import hindsight as hs


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.device = torch.device(os.environ.get("ZOO_DEVICE", "cpu"))
        if self.device.type == "cuda":
            self.device = torch.device("cuda", self.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.model = DDP(model.to(self.device), device_ids=[self.device] if self.device.type == "cuda" else None)

    def _run_batch(self, source, targets, i):
        source, targets = source.to(self.device), targets.to(self.device)
        accum = int(os.environ.get("ZOO_ACCUM", "1"))
        last = (i + 1) % accum == 0
        if accum == 1:
            self.optimizer.zero_grad()
        # Gradient accumulation as build-nanogpt writes it: no all-reduce
        # until the last micro-step, so until then each rank's differ.
        self.model.require_backward_grad_sync = last
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        if get_rank() == 1:
            loss = loss * float(os.environ.get("ZOO_RANK1_SCALE", "1"))
        loss.backward()
        if last:
            self.optimizer.step()
            if accum > 1:
                self.optimizer.zero_grad()
        return loss

    def train(self, max_epochs: int):
        with hs.checkpointing(model=self.model, optimizer=self.optimizer):
            for epoch in hs.loop("epoch", range(max_epochs)):
                self.train_data.sampler.set_epoch(epoch)
                hs.log("w_start", sum(p.double().sum().item() for p in self.model.parameters()))
                for i, (source, targets) in enumerate(hs.loop("step", self.train_data)):
                    loss = self._run_batch(source, targets, i)
                    first = not os.environ.get("HINDSIGHT_RESTART") and os.environ.get(
                        "TORCHELASTIC_RESTART_COUNT"
                    ) in (None, "0")
                    if epoch == int(os.environ.get("ZOO_CRASH_EPOCH", "-1")) and get_rank() == 1:
                        if first:  # the first launch only (not after hindsight run's or torchrun's restart)
                            raise RuntimeError("rank 1 crashed (ZOO_CRASH_EPOCH)")
                    if epoch == int(os.environ.get("ZOO_HANG_EPOCH", "-1")) and get_rank() == 1:
                        if first:
                            time.sleep(3600)  # rank 1 hangs; rank 0 waits in its next all-reduce
                    hs.log("loss", loss.item())
                    hs.log("rank_loss", loss.item(), rank="all")
                    time.sleep(float(os.environ.get("ZOO_SLEEP", "0.02")))


def load_train_objs():
    torch.manual_seed(0)
    train_set = MyTrainDataset(512)
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=False,
        shuffle=False,
        sampler=DistributedSampler(dataset, seed=int(os.environ.get("ZOO_RANK1_SEED", "0")) if get_rank() == 1 else 0),
    )


def main(total_epochs, batch_size):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    torch.manual_seed(100 + get_rank())  # each rank's own dropout stream
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer)
    trainer.train(total_epochs)
    if get_rank() == 0:
        w = trainer.model.module.state_dict()
        print("FINAL", repr(sum(v.double().sum().item() for v in w.values())))
    destroy_process_group()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("--batch_size", default=32, type=int)
    args = hs.args(parser)
    main(args.total_epochs, args.batch_size)

"""A training script shaped like pytorch/examples' mnist/main.py, recorded with
hindsight: argparse, the step loop inside `train()`, evaluation in `test()`,
the epoch loop in `main()` (synthetic data, so it runs anywhere in seconds).

Add `hs.log(...)` lines anywhere (in `train`, `test` or `main`) and run
`hindsight replay examples/functions_train.py`: the loops are found where
they ran, so epoch-level lines replay from checkpoints without training.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import hindsight as hs


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.dropout = nn.Dropout(0.25)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc2(self.dropout(F.relu(self.fc1(x)))), dim=1)


def train(args: argparse.Namespace, model: nn.Module, loader, optimizer, epoch: int) -> None:
    model.train()
    for batch_idx, (data, target) in enumerate(hs.loop("step", loader)):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            hs.log("train_loss", loss.item())


def test(model: nn.Module, loader) -> float:
    model.eval()
    test_loss, correct = 0.0, 0
    with torch.no_grad():
        for data, target in loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += int((output.argmax(dim=1) == target).sum())
    n = len(loader.dataset)
    hs.log("test_loss", test_loss / n)
    return correct / n


def main() -> None:
    parser = argparse.ArgumentParser(description="mnist-shaped example")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true")
    args = hs.args(parser)
    torch.manual_seed(args.seed)

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 64, generator=g)
    y = (x @ torch.randn(64, 10, generator=g)).argmax(dim=1)
    train_loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x[:384], y[:384]), batch_size=args.batch_size, shuffle=True
    )
    test_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[384:], y[384:]), batch_size=64)

    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    with hs.checkpointing(model=model, optimizer=optimizer, scheduler=scheduler):
        for epoch in hs.loop("epoch", range(1, args.epochs + 1)):
            train(args, model, train_loader, optimizer, epoch)
            accuracy = test(model, test_loader)
            hs.log("accuracy", accuracy)
            scheduler.step()


if __name__ == "__main__":
    main()

# Adapted from pytorch/examples, mnist/main.py
# (https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/mnist/main.py, BSD-3-Clause).
# Shape kept: argparse, train()/test() functions called from main(), the step
# loop `for batch_idx, (data, target) in enumerate(train_loader)` inside
# train(), Adadelta + StepLR, `torch.save(model.state_dict(), ...)` at the end.
# Changed for the zoo: hindsight (hs.args, hs.checkpointing, hs.loop, hs.log of
# what the script prints), a smaller CNN, seeded synthetic MNIST-shaped data
# instead of torchvision's download, the zoo test hook (zoo_hook), and
# `# zoo:` comments where the driver inserts probe statements.
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

import hindsight as hs
import zoo_hook


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(16 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


class SyntheticMNIST(torch.utils.data.Dataset):
    """Stands in for datasets.MNIST: 1x16x16 images, 10 classes, fixed by `seed`."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.rand(n, 1, 16, 16, generator=g)
        self.targets = (self.data.mean(dim=(1, 2, 3)) * 1000).long() % 10

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return (self.data[index] - 0.1307) / 0.3081, int(self.targets[index])


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(hs.loop("step", train_loader)):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        # zoo: step-probe: sum(p.grad.norm().item() for p in model.parameters())
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                epoch, batch_idx * len(data), len(train_loader.dataset),
                100. * batch_idx / len(train_loader), loss.item()))
            hs.log("loss", loss.item())
            if args.dry_run:
                break
        zoo_hook.step(epoch, batch_idx)


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction='sum').item()  # sum up batch loss
            pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
            correct += pred.eq(target.view_as(pred)).sum().item()

    test_loss /= len(test_loader.dataset)

    print('\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.0f}%)\n'.format(
        test_loss, correct, len(test_loader.dataset),
        100. * correct / len(test_loader.dataset)))
    hs.log("test_loss", test_loss)
    hs.log("test_correct", correct)


def main():
    # Training settings
    parser = argparse.ArgumentParser(description='PyTorch MNIST Example')
    parser.add_argument('--batch-size', type=int, default=32, metavar='N',
                        help='input batch size for training (default: 32)')
    parser.add_argument('--test-batch-size', type=int, default=128, metavar='N',
                        help='input batch size for testing (default: 128)')
    parser.add_argument('--epochs', type=int, default=3, metavar='N',
                        help='number of epochs to train (default: 3)')
    parser.add_argument('--lr', type=float, default=1.0, metavar='LR',
                        help='learning rate (default: 1.0)')
    parser.add_argument('--gamma', type=float, default=0.7, metavar='M',
                        help='Learning rate step gamma (default: 0.7)')
    parser.add_argument('--no-accel', action='store_true',
                        help='disables accelerator')
    parser.add_argument('--dry-run', action='store_true',
                        help='quickly check a single pass')
    parser.add_argument('--seed', type=int, default=1, metavar='S',
                        help='random seed (default: 1)')
    parser.add_argument('--log-interval', type=int, default=2, metavar='N',
                        help='how many batches to wait before logging training status')
    parser.add_argument('--save-model', action='store_true',
                        help='For Saving the current Model')
    parser.add_argument('--train-size', type=int, default=256, help='(zoo) synthetic training examples')
    args = hs.args(parser)

    use_accel = not args.no_accel and torch.accelerator.is_available()

    torch.manual_seed(args.seed)

    if use_accel:
        device = torch.accelerator.current_accelerator()
    else:
        device = torch.device("cpu")

    train_kwargs = {'batch_size': args.batch_size}
    test_kwargs = {'batch_size': args.test_batch_size}
    if use_accel:
        accel_kwargs = {'num_workers': 1,
                        'persistent_workers': True,
                        'pin_memory': True,
                        'shuffle': True}
        train_kwargs.update(accel_kwargs)
        test_kwargs.update(accel_kwargs)

    dataset1 = SyntheticMNIST(args.train_size, seed=1)
    dataset2 = SyntheticMNIST(128, seed=2)
    train_loader = torch.utils.data.DataLoader(dataset1, **train_kwargs)
    test_loader = torch.utils.data.DataLoader(dataset2, **test_kwargs)

    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    with hs.checkpointing(model=model, optimizer=optimizer, scheduler=scheduler):
        for epoch in hs.loop("epoch", range(1, args.epochs + 1)):
            train(args, model, device, train_loader, optimizer, epoch)
            test(model, device, test_loader)
            # zoo: epoch-probe: sum(p.norm().item() for p in model.parameters())
            scheduler.step()

    if args.save_model:
        torch.save(model.state_dict(), "mnist_cnn.pt")
    zoo_hook.final(model=model, optimizer=optimizer, scheduler=scheduler)


if __name__ == '__main__':
    main()

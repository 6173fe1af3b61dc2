# Adapted from pytorch/examples, vae/main.py
# (https://github.com/pytorch/examples/blob/77f55b912142e11fcfdf5b530231fb9c52f181e8/vae/main.py, BSD-3-Clause).
# Shape kept: module-level argparse and loaders, train(epoch)/test(epoch)
# functions reading the globals model/optimizer/loaders, the reparameterization
# trick (torch.randn_like inside the model's forward: every step draws from
# the global RNG), a `torch.randn(64, 20)` sample drawn in the epoch loop after
# test(), images written into results/ each epoch, `if __name__ == "__main__"`.
# Changed for the zoo: hindsight (hs.args, hs.checkpointing, hs.loop, hs.log of
# what it prints), a smaller VAE (784-64-8), seeded synthetic MNIST-shaped data
# in [0, 1] instead of torchvision's download, save_image replaced by
# torch.save of the tensor (no torchvision), the zoo test hook.
import argparse
import os

import torch
import torch.utils.data
from torch import nn, optim
from torch.nn import functional as F

import hindsight as hs
import zoo_hook

parser = argparse.ArgumentParser(description='VAE MNIST Example')
parser.add_argument('--batch-size', type=int, default=64, metavar='N',
                    help='input batch size for training (default: 64)')
parser.add_argument('--epochs', type=int, default=3, metavar='N',
                    help='number of epochs to train (default: 3)')
parser.add_argument('--no-accel', action='store_true',
                    help='disables accelerator')
parser.add_argument('--seed', type=int, default=1, metavar='S',
                    help='random seed (default: 1)')
parser.add_argument('--log-interval', type=int, default=3, metavar='N',
                    help='how many batches to wait before logging training status')
parser.add_argument('--train-size', type=int, default=512, help='(zoo) synthetic training images')
args = hs.args(parser)

torch.manual_seed(args.seed)
device = torch.device("cpu")


def synthetic_mnist(n, seed):
    """Stands in for datasets.MNIST with ToTensor(): blurry blobs in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, 1, 7, 7, generator=g)
    img = F.interpolate(low, size=(28, 28), mode='bilinear', align_corners=False).clamp(0, 1)
    return torch.utils.data.TensorDataset(img, torch.zeros(n, dtype=torch.long))


kwargs = {}
train_loader = torch.utils.data.DataLoader(
    synthetic_mnist(args.train_size, 1),
    batch_size=args.batch_size, shuffle=True, **kwargs)
test_loader = torch.utils.data.DataLoader(
    synthetic_mnist(128, 2),
    batch_size=args.batch_size, shuffle=False, **kwargs)


def save_image(tensor, path, nrow=8):
    torch.save(tensor, path + '.pt')


class VAE(nn.Module):
    def __init__(self):
        super(VAE, self).__init__()

        self.fc1 = nn.Linear(784, 64)
        self.fc21 = nn.Linear(64, 8)
        self.fc22 = nn.Linear(64, 8)
        self.fc3 = nn.Linear(8, 64)
        self.fc4 = nn.Linear(64, 784)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5*logvar)
        eps = torch.randn_like(std)
        return mu + eps*std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 784))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


model = VAE().to(device)
optimizer = optim.Adam(model.parameters(), lr=1e-3)


# Reconstruction + KL divergence losses summed over all elements and batch
def loss_function(recon_x, x, mu, logvar):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 784), reduction='sum')
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


def train(epoch):
    model.train()
    train_loss = 0
    for batch_idx, (data, _) in enumerate(hs.loop("step", train_loader)):
        data = data.to(device)
        optimizer.zero_grad()
        recon_batch, mu, logvar = model(data)
        loss = loss_function(recon_batch, data, mu, logvar)
        loss.backward()
        train_loss += loss.item()
        # zoo: step-probe: mu.abs().mean().item()
        # zoo: rng-probe: model(data)[0].mean().item()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print('Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}'.format(
                epoch, batch_idx * len(data), len(train_loader.dataset),
                100. * batch_idx / len(train_loader),
                loss.item() / len(data)))
            hs.log("loss", loss.item() / len(data))
        zoo_hook.step(epoch, batch_idx)

    print('====> Epoch: {} Average loss: {:.4f}'.format(
          epoch, train_loss / len(train_loader.dataset)))
    hs.log("avg_loss", train_loss / len(train_loader.dataset))


def test(epoch):
    model.eval()
    test_loss = 0
    with torch.no_grad():
        for i, (data, _) in enumerate(test_loader):
            data = data.to(device)
            recon_batch, mu, logvar = model(data)
            test_loss += loss_function(recon_batch, data, mu, logvar).item()
            if i == 0:
                n = min(data.size(0), 8)
                comparison = torch.cat([data[:n],
                                        recon_batch.view(args.batch_size, 1, 28, 28)[:n]])
                save_image(comparison.cpu(),
                           'results/reconstruction_' + str(epoch) + '.png', nrow=n)

    test_loss /= len(test_loader.dataset)
    print('====> Test set loss: {:.4f}'.format(test_loss))
    hs.log("test_loss", test_loss)


if __name__ == "__main__":
    os.makedirs('results', exist_ok=True)
    with hs.checkpointing(model=model, optimizer=optimizer):
        for epoch in hs.loop("epoch", range(1, args.epochs + 1)):
            train(epoch)
            test(epoch)
            with torch.no_grad():
                sample = torch.randn(64, 8).to(device)
                sample = model.decode(sample).cpu()
                save_image(sample.view(64, 1, 28, 28),
                           'results/sample_' + str(epoch) + '.png')
                hs.log("sample_mean", sample.mean().item())
            # zoo: epoch-probe: sum(p.norm().item() for p in model.parameters())
    zoo_hook.final(model=model, optimizer=optimizer)

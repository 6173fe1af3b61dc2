"""A small dataset with random augmentation, for `data_train.py`. Workers
import it by name (`toy_data:make`), so it lives in a module of its own."""

from __future__ import annotations

import random

import torch


class Noisy(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x.sum(dim=1) > 0).long()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Augmentation drawn from the global generators, as torchvision
        # transforms do: the worker seeds them per example.
        x = self.x[i] + 0.05 * torch.randn(16)
        if random.random() < 0.5:
            x = x.flip(0)
        return x, self.y[i]


def make(n: int = 640) -> Noisy:
    return Noisy(n)

"""Datasets for the input-service benchmark (``benches/bench_data.py``).

They live in a module of their own because ``hs.data.Loader`` workers are
separate processes that import the dataset factory by name
(``data_pipelines:augmented``); the benchmark's directory is on their path.

Every example carries its index, so the benchmark can audit an epoch for
duplicated and missing examples."""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

# ImageNet's channel statistics, as a typical pipeline normalizes with.
_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
_STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
_BLUR = torch.ones(3, 1, 5, 5) / 25


class Augmented(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """A CPU-bound augmentation pipeline, about 1 ms per example on one
    thread: a 3x``size``x``size`` image made from a per-index generator (the
    "decoded file"), then random crop, horizontal flip, colour jitter, small
    rotation, 5x5 blur, noise and normalization. The random draws come from
    the global ``random`` and ``torch`` generators, as torchvision's
    transforms make them (the hindsight worker seeds those per example)."""

    def __init__(self, n: int, size: int, crop: int):
        self.n, self.size, self.crop = n, size, crop

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        size, crop = self.size, self.crop
        img = torch.rand(3, size, size, generator=torch.Generator().manual_seed(i))
        dx, dy = random.randrange(size - crop + 1), random.randrange(size - crop + 1)
        img = img[:, dy : dy + crop, dx : dx + crop]
        if random.random() < 0.5:
            img = img.flip(2)
        # Colour jitter: brightness, contrast, saturation.
        img = img * (1 + (torch.rand(()) - 0.5) * 0.8)
        mean = img.mean()
        img = (img - mean) * (1 + (torch.rand(()) - 0.5) * 0.8) + mean
        gray = (0.299 * img[0] + 0.587 * img[1] + 0.114 * img[2])[None]
        img = ((img - gray) * (1 + (torch.rand(()) - 0.5) * 0.8) + gray).clamp(0, 1)
        # Rotation by up to 15 degrees either way.
        a = math.radians(random.uniform(-15, 15))
        theta = torch.tensor([[math.cos(a), -math.sin(a), 0.0], [math.sin(a), math.cos(a), 0.0]])[None]
        grid = F.affine_grid(theta, [1, 3, crop, crop], align_corners=False)
        img = F.grid_sample(img[None], grid, align_corners=False)
        img = F.conv2d(img, _BLUR, padding=2, groups=3)[0]
        img = img + 0.02 * torch.randn_like(img)
        return {
            "image": (img - _MEAN) / _STD,
            "label": torch.tensor(i % 1000),
            "index": torch.tensor(i),
        }


def augmented(n: int = 4096, size: int = 96, crop: int = 80) -> Augmented:
    return Augmented(n, size, crop)


class Tiny(torch.utils.data.Dataset[torch.Tensor]):
    """Almost no work per example: for measuring the service's bookkeeping."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def tiny(n: int = 1000) -> Tiny:
    return Tiny(n)

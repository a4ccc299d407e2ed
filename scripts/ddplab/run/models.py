"""The book's small model and its synthetic data: big enough to measure, small enough for a laptop.

``ResidualMLP`` is the feed-forward half of a transformer, stacked: 2.1 M parameters in 30 tensors
with the defaults (8 MiB of gradients), so DDP has several buckets to fill and a backward pass
long enough to overlap with.  ``make_clusters`` generates a classification task in a fraction of
a second, the same on every rank and every run: nothing to download.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm residual block: x + W₂ · gelu(W₁ · LayerNorm(x))."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, features: int = 64, width: int = 256, hidden: int = 1024,
                 blocks: int = 4, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.Sequential(*[Block(width, hidden) for _ in range(blocks)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.embed(x))))


def sgd(model: nn.Module, lr: float, momentum: float = 0.0) -> torch.optim.Optimizer:
    """The optimizer the chapters train with (each with its own learning rate)."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


# --8<-- [start:clusters]
def make_clusters(n: int, features: int = 64, classes: int = 10,
                  seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` labelled points in ``features`` dimensions, the same for a given ``seed``.

    Recipe: draw 4 cluster centres per class from N(0, I).  A sample is a random centre plus
    N(0, 2²·I) noise, scaled by 1/√5 to unit variance; its label is the centre's class.  Four
    clusters per class means no single hyperplane separates a class, so a network has
    something to learn; the clusters overlap, so accuracy stays below 100 %.
    """
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(4 * classes, features, generator=g)
    cluster = torch.randint(0, len(centres), (n,), generator=g)
    noise = torch.randn(n, features, generator=g)
    x = (centres[cluster] + 2.0 * noise) / math.sqrt(5.0)
    return x, cluster % classes
# --8<-- [end:clusters]

"""Chapter 01 exercises: ranks, their share of the data, and identical replicas.

Grade your work with `make grade-01` (the checks run on 1, 2 and 3 ranks, gloo on CPU).
"""

from __future__ import annotations

import torch  # noqa: F401 - you will need it
import torch.distributed as dist  # noqa: F401
from torch import nn


def shard(n_samples: int, rank: int, world_size: int) -> list[int]:
    """Exercise 01.1: the sample indices rank ``rank`` of ``world_size`` trains on.

    The same as ``list(DistributedSampler(range(n_samples), world_size, rank, shuffle=False))``:
    rank r takes r, r + N, r + 2N, ...; when N does not divide n_samples, the list of indices is
    first padded by repeating its beginning, so that every rank gets the same number.
    """
    raise NotImplementedError("exercise 01.1: interleave the indices, pad to equal lengths")


def broadcast_from_rank0(module: nn.Module) -> None:
    """Exercise 01.2: make this rank's replica identical to rank 0's, in place.

    Parameters and buffers (e.g. BatchNorm's running statistics): afterwards every rank's
    ``module.state_dict()`` equals rank 0's bit for bit.  Use ``dist.broadcast``.
    """
    raise NotImplementedError("exercise 01.2: broadcast every parameter and buffer from rank 0")


def replicas_equal(module: nn.Module) -> bool:
    """Exercise 01.3: True, on every rank, iff every rank's parameters and buffers are
    bitwise equal to every other rank's; else False on every rank."""
    raise NotImplementedError("exercise 01.3: compare with rank 0's copy, agree on the answer")

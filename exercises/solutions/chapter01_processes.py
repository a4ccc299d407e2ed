"""Chapter 01 solutions.  `make grade-01 FILE=<this file>`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


# --8<-- [start:shard]
def shard(n_samples: int, rank: int, world_size: int) -> list[int]:
    if n_samples == 0:
        return []
    per_rank = -(-n_samples // world_size)  # ceil: every rank takes as many steps as the others
    indices = list(range(n_samples))
    while len(indices) < per_rank * world_size:  # pad by repeating the beginning
        indices += indices[: per_rank * world_size - len(indices)]
    return indices[rank::world_size]  # interleaved: rank r takes r, r + N, ...
# --8<-- [end:shard]


# --8<-- [start:broadcast]
@torch.no_grad()
def broadcast_from_rank0(module: nn.Module) -> None:
    for tensor in [*module.parameters(), *module.buffers()]:  # buffers are state too
        dist.broadcast(tensor, src=0)  # rank 0 sends, every other rank overwrites its copy
# --8<-- [end:broadcast]


# --8<-- [start:equal]
@torch.no_grad()
def replicas_equal(module: nn.Module) -> bool:
    mine = [t.detach().clone() for t in module.state_dict().values()]
    theirs = [t.clone() for t in mine]
    for t in theirs:
        dist.broadcast(t, src=0)  # rank 0's copy, on every rank
    same = all(torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
               for a, b in zip(mine, theirs, strict=True))  # bits, not values (NaN, -0.0)
    # Agree: one rank that differs makes the answer False on every rank.
    flag = torch.tensor([0 if same else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0
# --8<-- [end:equal]

"""Chapter 11 solutions: sharding by hand.  `make grade-11 FILE=<this file>`.

The owner map first (who keeps which parameter's optimizer state), then ZeRO-1 on top of it,
then FSDP's reduce-scatter of a unit's gradients, and last the ledger that says, to the byte,
what every rank holds.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


# --8<-- [start:owners]
def owners(param_sizes: list[int], world_size: int) -> list[int]:
    owner = [0] * len(param_sizes)
    totals = [0] * world_size  # elements each rank owns so far
    largest_first = sorted(range(len(param_sizes)), key=lambda i: param_sizes[i], reverse=True)
    for i in largest_first:  # a stable sort: equal sizes keep their order
        rank = totals.index(min(totals))  # the first rank with the fewest elements
        owner[i] = rank
        totals[rank] += param_sizes[i]
    return owner
# --8<-- [end:owners]


# --8<-- [start:zero1]
class ShardedOptimizer:
    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        self.owner = owners([p.numel() for p in self.params], dist.get_world_size())
        mine = [p for p, r in zip(self.params, self.owner, strict=True) if r == dist.get_rank()]
        self.optim = optimizer_class(mine, **defaults)  # state for this rank's share only

    @torch.no_grad()
    def step(self) -> None:
        self.optim.step()  # the gradients are already averaged (DDP did it)
        for p, rank in zip(self.params, self.owner, strict=True):
            dist.broadcast(p, src=rank)  # every replica gets the owner's new value
# --8<-- [end:zero1]


# --8<-- [start:reduce_scatter]
def reduce_scatter_gradients(grads: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    message = shard_major(grads, world)
    mine = message.new_empty(message.shape[1])  # this rank's row, averaged over the ranks
    dist.reduce_scatter_single(mine, message.view(-1), op=dist.ReduceOp.AVG, group=group)
    return cut_back(mine, grads, rank, world)


def shard_major(grads: list[torch.Tensor], world: int) -> torch.Tensor:
    """Row k: rank k's chunk of every gradient in turn, each padded to ceil(d0 / world) rows."""
    widths = [math.ceil(g.shape[0] / world) * g[0].numel() for g in grads]
    message = grads[0].new_zeros(world, sum(widths))
    at = 0
    for g, width in zip(grads, widths, strict=True):
        for k, piece in enumerate(g.chunk(world)):
            message[k, at:at + piece.numel()] = piece.reshape(-1)
        at += width
    return message


def cut_back(row: torch.Tensor, grads: list[torch.Tensor], rank: int,
             world: int) -> list[torch.Tensor]:
    """This rank's shard of each gradient from its row: the padding stays behind."""
    shards, at = [], 0
    for g in grads:
        rows = math.ceil(g.shape[0] / world)
        owned = max(0, min(rows, g.shape[0] - rank * rows))  # the last ranks: fewer, or none
        shards.append(row[at:at + owned * g[0].numel()].view(owned, *g.shape[1:]))
        at += rows * g[0].numel()
    return shards
# --8<-- [end:reduce_scatter]


# --8<-- [start:ledger]
def rank_bytes(shapes: list[tuple[int, ...]], world_size: int, rank: int,
               stage: int) -> dict[str, int]:
    numel = [math.prod(s) for s in shapes]
    if stage == 0:  # DDP: everything, everywhere
        return {"params": 4 * sum(numel), "grads": 4 * sum(numel),
                "optimizer_state": 8 * sum(numel)}
    if stage == 1:  # ZeRO-1: the state of the whole parameters this rank owns
        owned = sum(n for n, r in zip(numel, owners(numel, world_size), strict=True)
                    if r == rank)
        return {"params": 4 * sum(numel), "grads": 4 * sum(numel), "optimizer_state": 8 * owned}
    padded = real = 0  # ZeRO-3 (fully_shard): dim-0 chunks of ⌈d/N⌉ rows, stored padded
    for shape in shapes:
        per_rank, inner = math.ceil(shape[0] / world_size), math.prod(shape[1:])
        padded += per_rank * inner
        real += max(0, min(per_rank, shape[0] - rank * per_rank)) * inner
    return {"params": 4 * padded, "grads": 4 * padded, "optimizer_state": 8 * real}
# --8<-- [end:ledger]

"""Mistakes: ZeRO-1 steps the parameters this rank owns and never sends them to the other ranks;
the ledger counts only the rows a rank really has under fully_shard, forgetting that FSDP2
stores every shard padded to ceil(d0 / N) rows."""

import math

import torch

from exercises.solutions import chapter11_sharding as solution
from exercises.solutions.chapter11_sharding import owners, reduce_scatter_gradients  # noqa: F401


class ShardedOptimizer(solution.ShardedOptimizer):
    @torch.no_grad()
    def step(self):
        self.optim.step()  # the replicas drift apart: only the owner has the new value


def rank_bytes(shapes, world_size, rank, stage):
    if stage != 3:
        return solution.rank_bytes(shapes, world_size, rank, stage)
    real = 0
    for shape in shapes:
        rows = math.ceil(shape[0] / world_size)
        real += max(0, min(rows, shape[0] - rank * rows)) * math.prod(shape[1:])
    return {"params": 4 * real, "grads": 4 * real, "optimizer_state": 8 * real}

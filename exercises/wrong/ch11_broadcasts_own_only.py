"""Mistake: each rank broadcasts only the parameters it owns.  A broadcast is a collective: every
rank must call it for every parameter, in the same order, the owner as src and the others to
receive; here the ranks call different broadcasts, and wait for each other."""

import torch
import torch.distributed as dist

from exercises.solutions import chapter11_sharding as solution
from exercises.solutions.chapter11_sharding import (  # noqa: F401
    owners,
    rank_bytes,
    reduce_scatter_gradients,
)


class ShardedOptimizer(solution.ShardedOptimizer):
    @torch.no_grad()
    def step(self):
        self.optim.step()
        for p, rank in zip(self.params, self.owner, strict=True):
            if rank == dist.get_rank():
                dist.broadcast(p, src=rank)

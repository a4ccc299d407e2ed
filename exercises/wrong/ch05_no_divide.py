"""Mistake: all-reduces the gradients but forgets to divide by the world size."""

import torch.distributed as dist

from exercises.solutions import chapter05_data_parallel as solution
from exercises.solutions.chapter05_data_parallel import accumulate_gradients  # noqa: F401


class DDP(solution.DDP):
    def _all_reduce_mean(self, bucket):
        for p in bucket:
            dist.all_reduce(p.grad)  # a SUM: native DDP averages

"""Chapter 06 solutions.  `make grade-06 FILE=<this file>`."""

from __future__ import annotations

import torch
import torch.distributed as dist


# --8<-- [start:idle]
def idle_per_rank(compute_ms: list[list[float]]) -> list[float]:
    idle = [0.0] * len(compute_ms[0])
    for step in compute_ms:
        slowest = max(step)  # the all-reduce ends when the last rank joins it
        for rank, ms in enumerate(step):
            idle[rank] += slowest - ms
    return idle
# --8<-- [end:idle]


# --8<-- [start:common_steps]
def common_steps(my_batches: int) -> int:
    count = torch.tensor([my_batches])
    dist.all_reduce(count, op=dist.ReduceOp.MIN)  # the shortest shard decides, on every rank
    return int(count)
# --8<-- [end:common_steps]

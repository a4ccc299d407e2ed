"""Chapter 06 exercises: where ranks wait.  Grade your work with `make grade-06`."""

from __future__ import annotations

import torch  # noqa: F401 - you may need it
import torch.distributed as dist  # noqa: F401


def idle_per_rank(compute_ms: list[list[float]]) -> list[float]:
    """Exercise 06.1: each rank's total idle time (ms).

    ``compute_ms[step][rank]`` is how long ``rank`` computed in ``step``; every step ends in a
    synchronous all-reduce that finishes only when every rank has joined (take its own cost
    as zero).  Return, per rank, the time it spent waiting for the others, summed over steps.
    """
    raise NotImplementedError("exercise 06.1: per step, each rank waits for the slowest one")


def common_steps(my_batches: int) -> int:
    """Exercise 06.2: the number of training steps every rank can take.

    Each rank passes how many batches its shard has (uneven inputs: they differ).  Return, on
    every rank, the largest number of steps that no rank runs out of data for.
    """
    raise NotImplementedError("exercise 06.2: agree on a number with one collective")

"""Chapter 03 exercises: the all-reduce, built from send and recv.

Grade your work with `make grade-03` (every exercise runs on 2 and 3 ranks, gloo on CPU).
While your code runs, the collectives (dist.all_reduce, dist.broadcast, ...) are switched off:
use dist.send / dist.recv / dist.isend / dist.irecv only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401 - you will need it


def naive_all_reduce(tensor: torch.Tensor, group=None) -> None:
    """Exercise 03.1: SUM ``tensor`` in place over the ranks of ``group``, through rank 0.

    Every other rank sends its tensor to rank 0; rank 0 adds them into its own and sends the
    sum back.  Afterwards every rank's ``tensor`` holds the sum.  ``group=None`` means all ranks;
    with a group, ``dist.send``/``dist.recv`` still take *global* ranks
    (``dist.get_global_rank(group, r)``).
    """
    raise NotImplementedError("exercise 03.1: send to rank 0, add there, send the sum back")


def ring_all_reduce(tensor: torch.Tensor, group=None) -> None:
    """Exercise 03.2: SUM ``tensor`` in place over ``group``, with the ring algorithm.

    Cut the flat tensor into N chunks (N = the group's size; sizes differ by at most one when N
    does not divide the number of elements).  Reduce-scatter: N-1 steps in which each rank sends
    one chunk to its right neighbour and adds the chunk arriving from its left one.  All-gather:
    N-1 more steps that pass the finished chunks round, copied instead of added.  Must work for
    any number of elements (0, 1, fewer than N, not divisible by N), any N >= 1, and float32,
    float64 and bfloat16, also for a non-contiguous ``tensor`` (a transposed view): the sum
    must end up in the tensor you were given.  Point-to-point calls only.  Returns None.
    """
    raise NotImplementedError("exercise 03.2: reduce-scatter then all-gather around the ring")


def ring_time(n_bytes: int, world_size: int, alpha_s: float, beta_s_per_byte: float) -> float:
    """Exercise 03.3: the alpha-beta model's time (seconds) of a ring all-reduce.

    A message of m bytes costs alpha + m * beta.  Return the time of a ring all-reduce of an
    ``n_bytes`` tensor over ``world_size`` ranks (0 when there is only one rank).
    """
    raise NotImplementedError("exercise 03.3: count the ring's messages and their sizes")

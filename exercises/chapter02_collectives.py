"""Chapter 02 exercises: three collectives, built from send and recv.

Grade your work with `make grade-02` (2 and 3 ranks, gloo on CPU).  While your code runs the
collectives are switched off: use dist.send / dist.recv / dist.isend / dist.irecv only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401 - you will need it


def broadcast(tensor: torch.Tensor, src: int) -> None:
    """Exercise 02.1: afterwards every rank's ``tensor`` holds rank ``src``'s (in place)."""
    raise NotImplementedError("exercise 02.1: src sends to every other rank, they receive")


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
    """Exercise 02.2: fill ``tensor_list[r]`` with rank r's ``tensor``, on every rank.

    ``tensor_list`` has one tensor per rank, each of ``tensor``'s size (like dist.all_gather).
    """
    raise NotImplementedError("exercise 02.2: send yours to everyone, receive everyone's")


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor]) -> None:
    """Exercise 02.3: rank r's ``output`` = the SUM over all ranks q of rank q's input_list[r].

    ``input_list`` has one tensor per rank, all of ``output``'s size (like dist.reduce_scatter).
    """
    raise NotImplementedError("exercise 02.3: send input_list[r] to rank r, add what arrives")

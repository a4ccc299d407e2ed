"""Chapter 02 solutions.  `make grade-02 FILE=<this file>`.

Simple versions: every rank talks to every other rank directly.  Sends are isend (they return
at once), so no rank blocks in a send while its peer blocks in another: no ordering puzzle.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


# --8<-- [start:broadcast]
def broadcast(tensor: torch.Tensor, src: int) -> None:
    if dist.get_rank() == src:
        sends = [dist.isend(tensor, r) for r in range(dist.get_world_size()) if r != src]
        for work in sends:
            work.wait()
    else:
        dist.recv(tensor, src)  # receives straight into the caller's tensor
# --8<-- [end:broadcast]


# --8<-- [start:all_gather]
def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    sends = [dist.isend(tensor, r) for r in range(world) if r != rank]
    for r in range(world):
        if r == rank:
            tensor_list[r].copy_(tensor)  # our own slot: no message needed
        else:
            dist.recv(tensor_list[r], r)
    for work in sends:
        work.wait()
# --8<-- [end:all_gather]


# --8<-- [start:reduce_scatter]
def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    sends = [dist.isend(input_list[r], r) for r in range(world) if r != rank]
    output.copy_(input_list[rank])
    incoming = torch.empty_like(output)
    for q in range(world):
        if q != rank:
            dist.recv(incoming, q)  # rank q's contribution to our slot
            output += incoming
    for work in sends:
        work.wait()
# --8<-- [end:reduce_scatter]

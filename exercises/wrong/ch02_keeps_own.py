"""Mistake: reduce_scatter sums the wrong slots (everyone's input_list[q] for the sender q)."""

import torch
import torch.distributed as dist

from exercises.solutions.chapter02_collectives import all_gather, broadcast  # noqa: F401


def reduce_scatter(output, input_list):
    rank, world = dist.get_rank(), dist.get_world_size()
    sends = [dist.isend(input_list[rank], r) for r in range(world) if r != rank]  # wrong slot
    output.copy_(input_list[rank])
    incoming = torch.empty_like(output)
    for q in range(world):
        if q != rank:
            dist.recv(incoming, q)
            output += incoming
    for work in sends:
        work.wait()

"""Mistake: reduce_scatter adds what the others sent but leaves out its own input_list[rank]."""

import torch
import torch.distributed as dist

from exercises.solutions.chapter02_collectives import all_gather, broadcast  # noqa: F401


def reduce_scatter(output, input_list):
    rank, world = dist.get_rank(), dist.get_world_size()
    sends = [dist.isend(input_list[r], r) for r in range(world) if r != rank]
    output.zero_()  # wrong: starts from zero, and this rank's own piece is never added
    incoming = torch.empty_like(output)
    for q in range(world):
        if q != rank:
            dist.recv(incoming, q)
            output += incoming
    for work in sends:
        work.wait()

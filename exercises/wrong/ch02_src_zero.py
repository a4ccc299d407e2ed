"""Mistakes: broadcast assumes src is 0; all_gather leaves its own slot empty."""

import torch.distributed as dist

from exercises.solutions.chapter02_collectives import reduce_scatter  # noqa: F401


def broadcast(tensor, src):
    if dist.get_rank() == 0:
        for r in range(1, dist.get_world_size()):
            dist.send(tensor, r)
    else:
        dist.recv(tensor, 0)


def all_gather(tensor_list, tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    sends = [dist.isend(tensor, r) for r in range(world) if r != rank]
    for r in range(world):
        if r != rank:
            dist.recv(tensor_list[r], r)
    for work in sends:
        work.wait()

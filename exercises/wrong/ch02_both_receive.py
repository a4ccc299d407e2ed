"""Mistake: all_gather receives first on every rank (blocking), so nobody ever sends."""

import torch.distributed as dist

from exercises.solutions.chapter02_collectives import broadcast, reduce_scatter  # noqa: F401


def all_gather(tensor_list, tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    for r in range(world):
        if r != rank:
            dist.recv(tensor_list[r], r)
    for r in range(world):
        if r != rank:
            dist.send(tensor, r)
    tensor_list[rank].copy_(tensor)

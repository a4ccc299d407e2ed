"""Mistake: naive_all_reduce passes group ranks to send/recv, which take global ranks."""

import torch
import torch.distributed as dist

from exercises.solutions.chapter03_ring_allreduce import ring_all_reduce, ring_time  # noqa: F401


def naive_all_reduce(tensor, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for r in range(1, world):
            dist.recv(incoming, r, group)  # wrong: r is a group rank
            tensor += incoming
        for r in range(1, world):
            dist.send(tensor, r, group)
    else:
        dist.send(tensor, 0, group)
        dist.recv(tensor, 0, group)

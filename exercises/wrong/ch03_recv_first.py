"""Mistake: every rank receives before it sends, so the ring deadlocks."""

import torch
import torch.distributed as dist

from exercises.solutions.chapter03_ring_allreduce import naive_all_reduce, ring_time  # noqa: F401


def ring_all_reduce(tensor, group=None):
    world, rank = dist.get_world_size(), dist.get_rank()
    chunks = list(tensor.view(-1).tensor_split(world))
    for step in range(world - 1):
        send, recv = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[recv])
        dist.recv(incoming, (rank - 1) % world)  # everyone waits here: nobody has sent yet
        dist.send(chunks[send], (rank + 1) % world)
        chunks[recv] += incoming

"""Mistake: the ring cuts tensor.reshape(-1), which is a copy when the tensor is not contiguous,
and never writes the sum back into the caller's tensor."""

import torch
import torch.distributed as dist

from exercises.solutions.chapter03_ring_allreduce import naive_all_reduce, ring_time  # noqa: F401


def ring_all_reduce(tensor, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1 or tensor.numel() == 0:
        return
    chunks = list(tensor.reshape(-1).tensor_split(world))  # wrong: a copy, when not contiguous
    to = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    right, left = to((rank + 1) % world), to((rank - 1) % world)

    def exchange(send_index, recv_index):
        incoming = torch.empty_like(chunks[recv_index])
        sending = dist.isend(chunks[send_index], right, group)
        dist.recv(incoming, left, group)
        sending.wait()
        return incoming

    for step in range(world - 1):
        chunks[(rank - step - 1) % world] += exchange((rank - step) % world,
                                                       (rank - step - 1) % world)
    for step in range(world - 1):
        chunks[(rank - step) % world].copy_(exchange((rank + 1 - step) % world,
                                                      (rank - step) % world))

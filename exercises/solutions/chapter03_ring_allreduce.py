"""Chapter 03 solutions: the all-reduce from send and recv.  `make grade-03 FILE=<this file>`."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _global(group, r: int) -> int:
    """send/recv take global ranks; inside a group, translate the group rank."""
    return r if group is None else dist.get_global_rank(group, r)


# --8<-- [start:naive]
def naive_all_reduce(tensor: torch.Tensor, group=None) -> None:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for r in range(1, world):  # rank 0's link carries (N-1) tensors in, (N-1) out
            dist.recv(incoming, _global(group, r), group)
            tensor += incoming
        for r in range(1, world):
            dist.send(tensor, _global(group, r), group)
    else:
        dist.send(tensor, _global(group, 0), group)
        dist.recv(tensor, _global(group, 0), group)
# --8<-- [end:naive]


# --8<-- [start:ring]
def ring_all_reduce(tensor: torch.Tensor, group=None) -> None:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1 or tensor.numel() == 0:
        return
    # Chunks are views of `flat`: adding into them changes it.  A non-contiguous tensor
    # (a transposed view, say) has no flat view, so the ring runs on a copy, written back.
    flat = tensor.contiguous().view(-1)
    # tensor_split gives N chunks whose sizes differ by at most one (some may be empty):
    # no remainder to forget, whatever the size.
    chunks = list(flat.tensor_split(world))
    right, left = _global(group, (rank + 1) % world), _global(group, (rank - 1) % world)

    def exchange(send_index: int, recv_index: int) -> torch.Tensor:
        # isend first, then recv: if every rank did a blocking recv first, all would wait.
        incoming = torch.empty_like(chunks[recv_index])
        sending = dist.isend(chunks[send_index], right, group)
        dist.recv(incoming, left, group)
        sending.wait()
        return incoming

    for step in range(world - 1):  # reduce-scatter: afterwards rank r owns chunk r+1, summed
        send, recv = (rank - step) % world, (rank - step - 1) % world
        chunks[recv] += exchange(send, recv)
    for step in range(world - 1):  # all-gather: pass the finished chunks round, copied
        send, recv = (rank + 1 - step) % world, (rank - step) % world
        chunks[recv].copy_(exchange(send, recv))
    if not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
# --8<-- [end:ring]


# --8<-- [start:ring_time]
def ring_time(n_bytes: int, world_size: int, alpha_s: float, beta_s_per_byte: float) -> float:
    # 2(N-1) steps (reduce-scatter, then all-gather), each one message of S/N bytes.
    steps = 2 * (world_size - 1)
    return steps * (alpha_s + n_bytes / world_size * beta_s_per_byte)
# --8<-- [end:ring_time]

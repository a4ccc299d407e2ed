"""Correct, built differently: the owner map from a heap, ZeRO-1's broadcasts launched together
and waited for at the end (as native's ``_sync_params`` does), the message built by
``torch._chunk_cat`` itself, and the ledger's rows counted by ``torch.chunk`` on meta tensors."""

import heapq
import math

import torch
import torch.distributed as dist


def owners(param_sizes, world_size):
    heap = [(0, rank) for rank in range(world_size)]  # (elements owned, rank): ties by rank
    owner = [0] * len(param_sizes)
    for i in sorted(range(len(param_sizes)), key=lambda i: -param_sizes[i]):
        total, rank = heapq.heappop(heap)
        owner[i] = rank
        heapq.heappush(heap, (total + param_sizes[i], rank))
    return owner


class ShardedOptimizer:
    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        self.owner = owners([p.numel() for p in self.params], dist.get_world_size())
        self.optim = optimizer_class(
            [p for p, r in zip(self.params, self.owner, strict=True) if r == dist.get_rank()],
            **defaults)

    @torch.no_grad()
    def step(self):
        self.optim.step()
        handles = [dist.broadcast(p, src=r, async_op=True)
                   for p, r in zip(self.params, self.owner, strict=True)]
        for handle in handles:
            handle.wait()


def reduce_scatter_gradients(grads, group=None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    message = torch._chunk_cat(grads, dim=0, num_chunks=world)  # (world, padded row)
    row = torch.empty_like(message[rank])
    dist.reduce_scatter_single(row, message.view(-1), op=dist.ReduceOp.AVG, group=group)
    widths = [math.ceil(g.shape[0] / world) * math.prod(g.shape[1:]) for g in grads]
    out = []
    for g, piece in zip(grads, row.split(widths), strict=True):
        real = g.chunk(world)[rank].shape[0] if rank < len(g.chunk(world)) else 0
        out.append(piece.view(-1, *g.shape[1:])[:real])
    return out


def rank_bytes(shapes, world_size, rank, stage):
    full = 4 * sum(math.prod(s) for s in shapes)
    if stage == 0:
        return {"params": full, "grads": full, "optimizer_state": 2 * full}
    if stage == 1:
        mine = [math.prod(s) for s, r in zip(shapes, owners([math.prod(s) for s in shapes],
                                                             world_size), strict=True)
                if r == rank]
        return {"params": full, "grads": full, "optimizer_state": 8 * sum(mine)}
    chunks = [torch.empty(s, device="meta").chunk(world_size) for s in shapes]
    padded = sum(c[0].numel() for c in chunks)
    real = sum(c[rank].numel() if rank < len(c) else 0 for c in chunks)
    return {"params": 4 * padded, "grads": 4 * padded, "optimizer_state": 8 * real}

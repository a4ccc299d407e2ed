"""What the textbook ring's tests run on every rank (importable, as mp.spawn requires)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from ring_workers import DTYPES, make_tensor, problems_with, sizes_to_check

import ddplab
from ddplab.ring import textbook_ring_all_reduce


def differs_from_the_relay(x: torch.Tensor, group=None) -> list[str]:
    """The two-loop ring and the relay add in the same order: their sums must be bit for bit
    the same, floats included, at any world size."""
    textbook, relay = x.clone(), x.clone()
    textbook_ring_all_reduce(textbook, group)
    ddplab.ring_all_reduce(relay, group)
    if torch.equal(textbook, relay):
        return []
    return [f"size={x.numel()} {x.dtype} N={dist.get_world_size(group)}: the textbook ring "
            "and ring_all_reduce differ"]


def textbook_matrix(ctx: ddplab.RankContext, args) -> list[str]:
    """Every size and dtype through the textbook ring, against dist.all_reduce and the relay."""
    problems = []
    for size in sizes_to_check(ctx.world_size):
        for dtype in DTYPES:
            x = make_tensor(size, dtype, ctx.rank)
            problems += problems_with(textbook_ring_all_reduce, x)
            problems += differs_from_the_relay(x)
    transposed = make_tensor(35, torch.float64, ctx.rank).reshape(5, 7).t()  # non-contiguous
    problems += problems_with(textbook_ring_all_reduce, transposed)
    problems += differs_from_the_relay(transposed)
    if ctx.world_size >= 3:  # a sub-group: send/recv must translate group ranks
        members = sorted([r for r in range(ctx.world_size) if r % 2 == 1] + [0])
        group = dist.new_group(ranks=members)
        if ctx.rank in members:
            problems += problems_with(textbook_ring_all_reduce,
                                      make_tensor(11, torch.float32, ctx.rank), group)
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, problems)
    return [p for rank_problems in everyone for p in rank_problems]

"""Rank functions for the ring halves tests (importable, as mp.spawn requires)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddplab.ring_halves import ring_all_gather, ring_reduce_scatter


def halves_against_gloo(ctx, args) -> dict | None:
    """For chunk sizes 0, 1, odd and past a segment: our reduce-scatter and all-gather against
    gloo's, on integer-valued floats (exact in any order) and random ones; the input left
    unchanged."""
    world, rank, found = ctx.world_size, ctx.rank, {}
    for per_rank in (0, 1, 7, 1000, 600_001):
        g = torch.Generator().manual_seed(rank)
        for kind in ("integers", "random"):
            message = (torch.randint(-50, 50, (per_rank * world,), generator=g).float()
                       if kind == "integers" else torch.randn(per_rank * world, generator=g))
            before = message.clone()
            ours, theirs = torch.empty(per_rank), torch.empty(per_rank)
            ring_reduce_scatter(ours, message, segment_bytes=1 << 20)
            dist.reduce_scatter_single(theirs, message)
            gathered, reference = torch.empty(per_rank * world), torch.empty(per_rank * world)
            ring_all_gather(gathered, ours, segment_bytes=1 << 20)
            dist.all_gather_single(reference, theirs)
            found[f"{kind}/{per_rank}"] = {
                "reduce_scatter": (ours - theirs).abs().max().item() if per_rank else 0.0,
                "all_gather_equal": torch.equal(gathered, reference) if kind == "integers"
                else True,
                "input_unchanged": torch.equal(message, before)}
    every = [None] * world
    dist.all_gather_object(every, found)
    return every if ctx.is_main else None

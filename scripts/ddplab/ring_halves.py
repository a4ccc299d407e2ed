"""Chapter 03's ring, cut in half: a reduce-scatter and an all-gather from send/recv.

``ring_all_reduce`` (``ring.py``) is two phases of N-1 steps: a reduce-scatter, after which each
rank holds the finished sum of one chunk, then an all-gather that passes the finished chunks
round.  Sharded training needs each half on its own: FSDP reduce-scatters gradients (each rank
keeps the sum of its shard) and all-gathers parameters (each rank gets every shard).

The halves reuse the ring's link (``ring._link``: receives posted ahead, pieces passed on as
they arrive).  Only the plan differs: which chunk arrives at which step, and whether it is added
or kept.  ``dist.reduce_scatter_tensor`` hands rank r chunk r, so the reduce-scatter starts one
chunk earlier than the all-reduce's first phase does: rank r sends chunk r-1 first, and the
chunk that arrives last, finished, is chunk r.  Each rank sends (N-1)/N·S bytes per half.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .ring import IN_FLIGHT, SEGMENT_BYTES, _link


# --8<-- [start:halves]
def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, *,
                        segment_bytes: int = SEGMENT_BYTES) -> torch.Tensor:
    """``output`` = the SUM over ranks of chunk r of ``input`` (N equal chunks), on rank r."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = input.detach().reshape(-1).clone().chunk(world)  # the input is left as it was
    # Step s: chunk (r-s-2) arrives from the left and is added in; N-1 steps end on chunk r.
    plan = [((rank - s - 2) % world, True) for s in range(world - 1)]
    _relay(group, rank, world, chunks, plan, first=(rank - 1) % world, segment_bytes=segment_bytes)
    output.copy_(chunks[rank].view_as(output))
    return output


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None, *,
                    segment_bytes: int = SEGMENT_BYTES) -> torch.Tensor:
    """``output`` = every rank's ``input``, in rank order (N·numel elements)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = output.view(-1).chunk(world)
    chunks[rank].copy_(input.reshape(-1))
    # Step s: chunk (r-s-1) arrives from the left and is kept as it is.
    plan = [((rank - s - 1) % world, False) for s in range(world - 1)]
    _relay(group, rank, world, chunks, plan, first=rank, segment_bytes=segment_bytes)
    return output
# --8<-- [end:halves]


def _relay(group, rank, world, chunks, plan, first: int, segment_bytes: int) -> None:
    """Send chunk ``first``, then at each step take the arriving chunk and pass it on."""
    if world == 1:
        return
    link = _link(group, rank, world, [(chunks[c], add) for c, add in plan], segment_bytes,
                 ahead=IN_FLIGHT)
    link.send(chunks[first])
    for step in range(len(plan)):
        link.relay(pass_on=step < len(plan) - 1)
    link.finish()

"""Functions the ring all-reduce tests run on every rank (importable, as mp.spawn requires)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import ddplab
from ddplab import ring
from ddplab.ring import SizeMismatchError

DTYPES = (torch.float32, torch.float64, torch.int64)


def sizes_to_check(world: int) -> list[int]:
    """Empty, smaller than N, one off a multiple of N, odd primes, and a large odd size."""
    return sorted({0, 1, max(world - 1, 1), world + 1, 7, 13, 101, 1_000_003})


def make_tensor(size: int, dtype: torch.dtype, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * size + rank)
    if dtype.is_floating_point:
        return torch.randn(size, generator=g, dtype=dtype)
    return torch.randint(-10**6, 10**6, (size,), generator=g, dtype=dtype)


def problems_with(impl, x: torch.Tensor, group=None) -> list[str]:
    """Compare impl(x) with dist.all_reduce(x); return what went wrong ([] if nothing)."""
    n = dist.get_world_size(group)
    ours, reference = x.clone(), x.clone()
    returned = impl(ours, group=group)
    dist.all_reduce(reference, group=group)
    where = f"{impl.__name__} size={x.numel()} {x.dtype} N={n}"
    problems = []
    if returned is not ours:
        problems.append(f"{where}: did not return its input (in place)")
    if x.is_floating_point():
        # Two summation orders differ by at most (N-1)·eps·Σ|x_i| per element.
        magnitude = x.double().abs()
        dist.all_reduce(magnitude, group=group)
        bound = max(n - 1, 1) * torch.finfo(x.dtype).eps * magnitude
        if not ((ours.double() - reference.double()).abs() <= bound).all():
            problems.append(f"{where}: differs from dist.all_reduce beyond the rounding bound")
    elif not torch.equal(ours, reference):
        problems.append(f"{where}: integers differ from dist.all_reduce")
    rank0 = ours.clone()
    dist.broadcast(rank0, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    if not torch.equal(ours, rank0):
        problems.append(f"{where}: ranks hold different results")
    return problems


def unchecked_ring(x: torch.Tensor, group=None) -> torch.Tensor:
    return ddplab.ring_all_reduce(x, group, check=False)


def correctness_matrix(ctx: ddplab.RankContext, args) -> list[str]:
    """Every size and dtype through ring_all_reduce, and a few through naive_all_reduce."""
    problems = []
    for size in sizes_to_check(ctx.world_size):
        for dtype in DTYPES:
            x = make_tensor(size, dtype, ctx.rank)
            problems += problems_with(ddplab.ring_all_reduce, x)
            if size < 1000:
                problems += problems_with(ddplab.naive_all_reduce, x)
    # The fast path (no size check) gives the same sums.
    for size in sizes_to_check(ctx.world_size):
        problems += problems_with(unchecked_ring, make_tensor(size, torch.float32, ctx.rank))
    # A non-contiguous tensor (a transposed matrix) is reduced in place as well.
    m = make_tensor(35, torch.float64, ctx.rank).reshape(5, 7).t()
    problems += problems_with(ddplab.ring_all_reduce, m)
    # Small segments: many messages per chunk, and a chunk ending in a partial segment.
    x = make_tensor(1001, torch.int64, ctx.rank)
    problems += problems_with(lambda t, group: ddplab.ring_all_reduce(t, group, segment_bytes=80),
                              x)
    if ctx.world_size >= 3:  # a sub-group: send/recv must translate group ranks
        members = [r for r in range(ctx.world_size) if r % 2 == 1] + [0]
        group = dist.new_group(ranks=sorted(members))
        if ctx.rank in members:
            problems += problems_with(ddplab.ring_all_reduce, make_tensor(11, torch.int64,
                                                                          ctx.rank), group)
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, problems)
    return [p for rank_problems in everyone for p in rank_problems]


def kept_receive_buffers(ctx: ddplab.RankContext, args) -> list:
    """Calls in a row: which receive buffers each one left for the next, and its problems."""
    def kept() -> dict:
        return {f"{slot} {dtype}": t.data_ptr() for (slot, dtype, _), t in ring._KEPT.free.items()}

    report, problems = [], []
    for size, dtype in ((1 << 18, torch.float32), (1 << 18, torch.float32),
                        (1000, torch.float32), (1 << 18, torch.float64), (1 << 18, torch.float32)):
        problems += problems_with(unchecked_ring, make_tensor(size, dtype, ctx.rank))
        report.append(kept())
    return [report, problems]


def grouped_exchange_matrix(ctx: ddplab.RankContext, args) -> list[str]:
    """The nccl exchange (send and receive as one batch_isend_irecv), run here on gloo."""
    pick_link = ring._link

    def grouped_link(group, rank, world, incoming, segment_bytes, ahead):
        return ring._GroupedLink(group, rank, world, incoming)

    ring._link = grouped_link
    problems = []
    try:
        for size in sizes_to_check(ctx.world_size):
            for dtype in (torch.float32, torch.int64):
                x = make_tensor(size, dtype, ctx.rank)
                problems += problems_with(ddplab.ring_all_reduce, x)
    finally:
        ring._link = pick_link
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, problems)
    return [p for rank_problems in everyone for p in rank_problems]


def mismatched_tensors(ctx: ddplab.RankContext, args) -> list[str]:
    """Rank 1 passes a longer tensor, then a float64 one: every rank must raise, not hang."""
    messages = []
    for size, dtype in ((11, torch.float32), (10, torch.float64)):
        x = torch.ones(size if ctx.rank == 1 else 10,
                       dtype=dtype if ctx.rank == 1 else torch.float32)
        try:
            ddplab.ring_all_reduce(x)
            messages.append("no error")
        except SizeMismatchError as err:
            messages.append(str(err))
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, messages)
    return everyone


def traced_ring(ctx: ddplab.RankContext, args) -> list:
    """The trace hook's records: (phase, step, sent chunk, received chunk)."""
    records = []
    ddplab.ring_all_reduce(torch.ones(ctx.world_size * 3), trace=lambda s: records.append(
        (s.phase, s.step, s.sent_chunk, s.received_chunk, [float(c.sum()) for c in s.chunks])))
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, records)
    return everyone

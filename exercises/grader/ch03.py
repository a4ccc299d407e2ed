"""Chapter 03: the all-reduce from send/recv (naive, then the ring) and its alpha-beta cost."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from .core import Context, Exercise
from .guard import Mistake
from .sums import diagnose_sum, rank_tensor

HANG = ("A ring where every rank receives before it sends waits forever: use isend/irecv (or let "
        "even ranks send first), and check that every send has a matching recv.")
DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _sizes(world: int) -> list[int]:
    # 0 and 1 element, fewer elements than ranks, not divisible by the world size, and larger.
    # Largest first: a mistake shows most clearly on a big tensor.
    return sorted({0, 1, max(world - 1, 1), 7, 1003, 4099}, reverse=True)


def check_all_reduce(ctx: Context, fn, label: str) -> None:
    """``fn(tensor, group=...)`` sums in place over the group, for every size and dtype."""
    for dtype in DTYPES:
        for numel in _sizes(ctx.world_size):
            inputs = [rank_tensor(r, numel, dtype) for r in range(ctx.world_size)]
            reference = inputs[ctx.rank].clone()
            dist.all_reduce(reference)  # the real thing (gloo's ring)
            mine = inputs[ctx.rank].clone()
            ctx.call(fn, mine)
            what = f"{label} of a {numel}-element {str(dtype).replace('torch.', '')} tensor"
            diagnose_sum(mine, inputs, ctx.rank, reference, what)
            _same_on_every_rank(ctx, mine, what)
    if ctx.world_size == 3:  # a group without rank 0: send/recv take *global* ranks
        group = dist.new_group([1, 2])
        if ctx.rank in (1, 2):
            inputs = [rank_tensor(r, 11, torch.float64) for r in (1, 2)]
            mine = inputs[ctx.rank - 1].clone()
            ctx.call(fn, mine, group=group)
            try:
                diagnose_sum(mine, inputs, ctx.rank - 1, None, f"{label} over group [1, 2]")
            except Mistake as error:
                raise Mistake(f"{error} With a group, dist.send/recv take global ranks: "
                              "translate with dist.get_global_rank(group, r).") from None
        dist.barrier()


def _same_on_every_rank(ctx: Context, mine: torch.Tensor, what: str) -> None:
    everyone = ctx.gather(mine)
    for r, theirs in enumerate(everyone):
        if not torch.equal(theirs.view(-1).view(torch.uint8), mine.view(-1).view(torch.uint8)):
            differ = int((theirs != mine).nonzero()[0]) if mine.numel() else 0
            raise Mistake(f"{what}: rank {ctx.rank} and rank {r} hold different sums (first at "
                          f"element {differ}): every rank must end with the very same bits; the "
                          "all-gather phase copies each finished chunk from the rank that owns it")


def check_naive(ctx: Context) -> None:
    check_all_reduce(ctx, ctx.learner.naive_all_reduce, "naive_all_reduce")


def check_non_contiguous(ctx: Context, fn, label: str) -> None:
    """A transposed view (not contiguous): the sum must land in the caller's tensor itself."""
    rows, cols = 37, 29  # 1073 elements: divisible by neither 2 nor 3
    inputs = [rank_tensor(r, rows * cols, torch.float32, seed=5).view(rows, cols).t()
              for r in range(ctx.world_size)]
    mine = inputs[ctx.rank].clone().t().contiguous().t()  # the same strides as the input
    assert not mine.is_contiguous()
    ctx.call(fn, mine)
    what = f"{label} of a non-contiguous {cols}x{rows} tensor (a transposed view)"
    if torch.equal(mine, inputs[ctx.rank]):
        raise Mistake(f"{what}: rank {ctx.rank}'s tensor did not change, so the sum was never "
                      "written back into the caller's tensor. On a non-contiguous tensor "
                      "reshape(-1), flatten() and contiguous() return a copy (view(-1) raises), "
                      "so your chunks were slices of that copy: sum into the copy, then "
                      "tensor.copy_(flat.view_as(tensor)).")
    terms = [t.contiguous() for t in inputs]
    reference = terms[0] + terms[1] if ctx.world_size == 2 else None  # one rounding: exact
    diagnose_sum(mine.contiguous(), terms, ctx.rank, reference, what)
    _same_on_every_rank(ctx, mine.contiguous(), what)


def check_ring(ctx: Context) -> None:
    check_all_reduce(ctx, ctx.learner.ring_all_reduce, "ring_all_reduce")
    if ctx.world_size > 1:  # on 1 rank the tensor is its own sum: nothing to write back
        check_non_contiguous(ctx, ctx.learner.ring_all_reduce, "ring_all_reduce")
    if ctx.world_size == 2:
        ctx.feedback.update(_bandwidth(ctx))


def _bandwidth(ctx: Context) -> dict:
    """Bus bandwidth of the learner's ring next to gloo's, for the feedback figure."""
    sizes = [1 << 10, 1 << 14, 1 << 18, 1 << 20]
    series = {"your ring_all_reduce": [], "dist.all_reduce (gloo)": []}
    for numel in sizes:
        tensor = torch.ones(numel)
        for label, fn in (("your ring_all_reduce", ctx.learner.ring_all_reduce),
                          ("dist.all_reduce (gloo)", dist.all_reduce)):
            times = []
            for _ in range(3):
                dist.barrier()
                start = time.perf_counter()
                ctx.call(fn, tensor) if fn is not dist.all_reduce else fn(tensor)
                times.append(time.perf_counter() - start)
            busbw = 2 * (ctx.world_size - 1) / ctx.world_size * numel * 4 / min(times) / 1e9
            series[label].append(busbw)
    return {"figure": "lines", "x": [n * 4 for n in sizes], "series": series,
            "xlabel": "tensor size (bytes)", "ylabel": "bus bandwidth (GB/s)",
            "title": "your ring next to gloo's (2 ranks, best of 3)"}


def check_ring_time(ctx: Context) -> None:
    fn = ctx.learner.ring_time
    cases = [(1 << 20, 4, 50e-6, 1e-9), (1000, 2, 1e-5, 2e-9), (8 << 20, 8, 2e-6, 1e-10),
             (4096, 1, 1e-5, 1e-9)]
    for n_bytes, world, alpha, beta in cases:
        want = 2 * (world - 1) * alpha + 2 * (world - 1) / world * n_bytes * beta
        got = ctx.call(fn, n_bytes, world, alpha, beta)
        if not isinstance(got, (int, float)) or not math.isclose(got, want, rel_tol=1e-9,
                                                                 abs_tol=1e-15):
            raise Mistake(f"ring_time({n_bytes}, {world}, {alpha}, {beta}) = {got}, expected "
                          f"{want:.6g} s. {_ring_time_cause(got, n_bytes, world, alpha, beta)}")


def _ring_time_cause(got, n, world, alpha, beta) -> str:
    if not isinstance(got, (int, float)):
        return "Return a number of seconds."
    latency, bandwidth = 2 * (world - 1) * alpha, 2 * (world - 1) / world * n * beta
    options = {
        "Both phases (reduce-scatter, then all-gather) take N - 1 steps: count 2(N - 1).":
            (latency + bandwidth) / 2,
        "Each step sends one chunk, S/N bytes, not the whole tensor.":
            latency + bandwidth * world,
        "The latency alpha is paid once per step: 2(N - 1) times.": alpha + bandwidth,
    }
    for cause, value in options.items():
        if math.isclose(got, value, rel_tol=1e-6):
            return cause
    return "The ring's time is 2(N-1)·alpha + 2(N-1)/N·S·beta."


EXERCISES = [
    # 1 rank too: the fixed interface holds for any world size >= 1
    Exercise("03.1", "naive_all_reduce", check_naive, (1, 2, 3), p2p_only=True, hang_hint=HANG),
    Exercise("03.2", "ring_all_reduce", check_ring, (1, 2, 3), p2p_only=True, hang_hint=HANG),
    Exercise("03.3", "ring_time", check_ring_time, world_sizes=(1,)),
]

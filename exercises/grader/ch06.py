"""Chapter 06: bubbles — idle time from per-step compute times; agreeing on uneven inputs."""

from __future__ import annotations

import math

import torch

from .core import Context, Exercise
from .guard import Mistake


def check_idle(ctx: Context) -> None:
    cases = [
        [[10.0, 10.0]],  # balanced: nobody waits
        [[10.0, 14.0], [10.0, 14.0]],  # rank 1 is the straggler twice
        [[12.0, 10.0, 11.0], [10.0, 15.0, 10.0], [9.0, 9.0, 9.5]],  # the straggler moves
        [[5.0]],  # one rank
    ]
    for compute in cases:
        want = [sum(max(step) - step[r] for step in compute) for r in range(len(compute[0]))]
        got = ctx.call(ctx.learner.idle_per_rank, compute)
        if len(got) != len(want) or not all(math.isclose(g, w, abs_tol=1e-9)
                                            for g, w in zip(got, want, strict=False)):
            raise Mistake(f"idle_per_rank({compute}) = {list(got)}, expected {want}. "
                          f"{_idle_cause(got, compute)}")


def _idle_cause(got, compute) -> str:
    ranks = range(len(compute[0]))
    mean = [sum(sum(s) / len(s) - s[r] for s in compute) for r in ranks]
    totals = [sum(s[r] for s in compute) for r in ranks]
    by_totals = [max(totals) - t for t in totals]
    if all(math.isclose(g, m, abs_tol=1e-9) for g, m in zip(got, mean, strict=False)):
        return ("That is the distance to the mean: a rank waits for the SLOWEST rank (max), "
                "since the all-reduce ends only when every rank has joined.")
    if all(math.isclose(g, b, abs_tol=1e-9) for g, b in zip(got, by_totals, strict=False)):
        return ("That compares total compute times: the ranks meet at EVERY step, so a rank "
                "waits for each step's slowest rank, even when it is slow itself in another "
                "step.")
    return "In each step, rank r waits max(step) - step[r] for the slowest rank."


def check_common_steps(ctx: Context) -> None:
    for counts in ([5, 3, 4], [2, 2, 2], [0, 7, 1], [9, 8, 10]):
        mine = counts[ctx.rank % len(counts)]
        want = min(counts[r % len(counts)] for r in range(ctx.world_size))
        got = ctx.call(ctx.learner.common_steps, mine)
        got = int(got) if isinstance(got, (int, torch.Tensor)) else got
        answers = ctx.gather(got)  # every rank's answer: the mistake shows in their pattern
        if got != want:
            everyone = [counts[r % len(counts)] for r in range(ctx.world_size)]
            if answers == everyone:
                cause = ("that is this rank's own count: a rank that runs more steps than the "
                         "others waits forever in its extra all-reduces (the uneven-inputs hang);"
                         " agree with dist.all_reduce(..., op=dist.ReduceOp.MIN)")
            elif answers == [max(everyone)] * ctx.world_size:
                cause = "that is the maximum: the ranks with fewer batches have no data to run"
            else:
                cause = "every rank must return the smallest count of all ranks"
            raise Mistake(f"with {everyone} batches on ranks 0..{ctx.world_size - 1}, rank "
                          f"{ctx.rank} returned {got}, expected {want}: {cause}")


EXERCISES = [
    Exercise("06.1", "idle_per_rank", check_idle, world_sizes=(1,)),
    Exercise("06.2", "common_steps", check_common_steps),
]

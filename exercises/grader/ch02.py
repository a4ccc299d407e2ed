"""Chapter 02: the collectives, rebuilt from send and recv (the collectives are switched off).

Broadcast and all-gather copy bytes, so they are compared bit for bit with dist.broadcast and
dist.all_gather at any world size; reduce-scatter adds, so it is checked like chapter 03's sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .core import Context, Exercise
from .guard import Mistake
from .sums import close, diagnose_sum, rank_tensor

HANG = ("Every send needs a matching recv on the other rank (same peer, same size); a rank that "
        "only receives, or two ranks that both receive first, wait forever.")


def check_broadcast(ctx: Context) -> None:
    for src in range(ctx.world_size):
        for numel in (1000, 1, 0):
            want = rank_tensor(src, numel, torch.float32, seed=2)
            mine = rank_tensor(ctx.rank, numel, torch.float32, seed=2)
            ctx.call(ctx.learner.broadcast, mine, src)
            if not torch.equal(mine, want):
                unchanged = torch.equal(mine, rank_tensor(ctx.rank, numel, torch.float32, seed=2))
                hint = ("This rank's tensor did not change: did it receive into the tensor it "
                        "was given?" if unchanged else "Copy rank src's tensor into yours.")
                raise Mistake(f"broadcast from rank {src} of {numel} elements: rank {ctx.rank} "
                              f"does not hold rank {src}'s tensor. {hint} (src is not always 0)")


def check_all_gather(ctx: Context) -> None:
    for numel in (513, 1):
        mine = rank_tensor(ctx.rank, numel, torch.float64, seed=3)
        out = [torch.full((numel,), float("nan"), dtype=torch.float64)
               for _ in range(ctx.world_size)]
        ctx.call(ctx.learner.all_gather, out, mine)
        want = [torch.empty_like(mine) for _ in range(ctx.world_size)]
        dist.all_gather(want, mine)  # the real thing (outside the learner's code: allowed)
        for r in range(ctx.world_size):
            if not torch.equal(out[r], want[r]):
                if torch.isnan(out[r]).all():
                    cause = ("it was never filled" + (": your own tensor goes into your own "
                                                      "slot too" if r == ctx.rank else ""))
                else:
                    cause = "it holds another rank's tensor: slot r is rank r's"
                raise Mistake(f"rank {ctx.rank}: tensor_list[{r}] ({numel} elements) is not "
                              f"rank {r}'s tensor: {cause}")


def check_reduce_scatter(ctx: Context) -> None:
    world = ctx.world_size
    for numel in (301, 1):
        # inputs[q][r]: the r-th input of rank q; rank r must end with sum over q of inputs[q][r]
        inputs = [[rank_tensor(q * 10 + r, numel, torch.float32, seed=4) for r in range(world)]
                  for q in range(world)]
        output = torch.zeros(numel)
        ctx.call(ctx.learner.reduce_scatter, output, [t.clone() for t in inputs[ctx.rank]])
        reference = inputs[0][ctx.rank] + inputs[1][ctx.rank] if world == 2 else None
        terms = [inputs[q][ctx.rank] for q in range(world)]
        try:
            diagnose_sum(output, terms, ctx.rank, reference,
                         f"reduce_scatter into rank {ctx.rank}'s output", _reduce_scatter_cause)
        except Mistake as error:
            own = [inputs[ctx.rank][r] for r in range(world)]
            what = (" It is one of this rank's own inputs." if any(torch.equal(output, t)
                                                                  for t in own) else "")
            raise Mistake(f"{error}{what} Rank r's output is the sum over the ranks of "
                          "their input_list[r]: send input_list[r] to rank r, add what "
                          "arrives.") from None


def _reduce_scatter_cause(result, terms, exact, _wrong, rank) -> str:
    """The likely mistake, in reduce-scatter's terms (it has no chunks and no all-gather)."""
    if close(result, exact - terms[rank].double()):
        return (f"It is the sum of what the other ranks sent, without rank {rank}'s own piece: "
                f"add your own input_list[{rank}] too (start from output.copy_(input_list[rank])).")
    if close(result, exact * len(terms)) or close(result, exact * 2):
        return "It is a multiple of the sum: was some rank's piece added twice?"
    if close(result, exact / len(terms)):
        return "It is the average, not the sum: a reduce-scatter SUM does not divide."
    return ""


EXERCISES = [
    Exercise("02.1", "broadcast", check_broadcast, p2p_only=True, hang_hint=HANG),
    Exercise("02.2", "all_gather", check_all_gather, p2p_only=True, hang_hint=HANG),
    Exercise("02.3", "reduce_scatter", check_reduce_scatter, p2p_only=True, hang_hint=HANG),
]

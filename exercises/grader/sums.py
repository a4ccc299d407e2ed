"""Checking a learner's SUM against the real one, and saying in words what went wrong.

Bitwise where the math allows, a bound where it does not:

* at 2 ranks every element of the sum is one addition, a + b, and a + b == b + a exactly in IEEE
  arithmetic: any correct all-reduce equals ``dist.all_reduce`` bit for bit;
* at 3 or more ranks the order of the additions is the implementation's choice ((a + b) + c or
  a + (b + c)), and float addition is not associative.  So the learner's result is compared with
  the exact sum (computed in float64) and may differ from it by what any order of N - 1 roundings
  can cause: |error| <= (N - 1) · u · Σ|x_i|, u the unit roundoff of the dtype (Higham, "Accuracy
  and Stability of Numerical Algorithms", 2nd ed., eq. 4.4).  A wrong algorithm misses by far more.
"""

from __future__ import annotations

import torch

from .guard import Mistake

GENERIC = "Check which chunk each step sends and which one it adds into."


def rank_tensor(rank: int, numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """The tensor rank ``rank`` contributes: reproducible, different on every rank."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return (torch.rand(numel, generator=gen, dtype=torch.float64) * 2 - 1).to(dtype)


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def diagnose_sum(result: torch.Tensor, inputs: list[torch.Tensor], rank: int,
                 reference: torch.Tensor | None, what: str, explain=None) -> None:
    """Raise a Mistake naming the first wrong element and the likely cause, if any.

    ``explain(result, inputs, exact, wrong, rank) -> str`` names the cause in the exercise's
    terms; the default knows the all-reduce's (in place, chunks, all-gather phase)."""
    world, numel = len(inputs), inputs[0].numel()
    exact = torch.stack([t.double() for t in inputs]).sum(0) if numel else torch.zeros(0)
    bound = (world - 1) * unit_roundoff(inputs[0].dtype) * \
        torch.stack([t.double().abs() for t in inputs]).sum(0) if numel else exact
    if result.dtype != inputs[0].dtype or result.shape != inputs[0].shape:
        raise Mistake(f"{what}: the tensor became {result.dtype} of shape {tuple(result.shape)}; "
                      f"it must stay {inputs[0].dtype} of shape {tuple(inputs[0].shape)}")
    if world == 2 and reference is not None:
        wrong = result.view(-1) != reference.view(-1)
        if torch.isnan(reference).any():
            wrong &= ~(torch.isnan(result) & torch.isnan(reference))
    else:
        wrong = (result.double() - exact).abs() > bound + 1e-300
    if not wrong.any():
        return
    index = int(wrong.nonzero()[0])
    got, want = float(result.view(-1)[index]), float(exact[index])
    first = (f"{what}: rank {rank}, element {index} of {numel} is {_fmt(got)}, expected "
             f"{_fmt(want)} (the sum over {world} ranks; off by {_fmt(abs(got - want))})")
    cause = (explain or _likely_cause)(result, inputs, exact, wrong, rank)
    raise Mistake(f"{first}. {cause}".rstrip())


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Near enough to name a likely cause (not to pass: the check itself is exact or bounded)."""
    return torch.allclose(a.double().view(-1), b.double().view(-1), rtol=1e-2, atol=1e-2)


def _likely_cause(result, inputs, exact, wrong, rank) -> str:
    world, numel = len(inputs), inputs[0].numel()
    res = result.double().view(-1)
    if torch.equal(result.view(-1), inputs[rank].view(-1)):
        return ("Your tensor did not change at all: the all-reduce is in place, so write the "
                "sum into the tensor you were given (tensor.copy_(...) or tensor += ...).")
    if close(res, exact * world) or close(res, exact * 2):
        return "It is a multiple of the sum: did some chunk get added twice?"
    if close(res, exact / world):
        return "It is the average, not the sum: an all-reduce SUM does not divide."
    tail = numel % world
    if tail and bool(wrong[-tail:].all()) and not bool(wrong[:-tail].any()):
        return (f"Only the last {tail} element(s) are wrong ({numel} is not divisible by "
                f"{world}): did you drop the remainder when cutting the tensor into chunks?")
    right = (~wrong).double().mean().item()
    if world > 1 and 0.5 / world <= right <= 1.5 / world:
        return (f"Only {right:.0%} of the elements (about one chunk in {world}) hold the full "
                "sum: did you skip the all-gather phase?")
    single = torch.zeros_like(wrong)
    for t in inputs:  # elements that hold one rank's value, not a sum
        single |= result.view(-1) == t.view(-1)
    single &= wrong
    if world > 1 and single.double().mean().item() > 0.2:
        return (f"{single.double().mean().item():.0%} of the elements hold a single rank's "
                "value instead of the sum: a chunk was passed on before it was finished, or "
                "to the wrong place (check the chunk indices, especially in the all-gather).")
    if world > 1 and 0 < right < 0.75:
        return (f"Only {right:.0%} of the elements hold the full sum: did you skip the all-gather "
                "phase (or copy the finished chunks to the wrong place)?")
    return GENERIC

"""Timing that can be trusted on a noisy machine.

Rules the chapters follow, and this module enforces:

* warm-up steps are run and thrown away (first calls allocate, fill caches, build NCCL rings);
* every timed step starts together on all ranks: a barrier *outside* the timed region;
* GPU work is waited for (``torch.cuda.synchronize``) before the clock is read;
* variants are compared in one run, interleaved A B A B…, so a slow minute hurts all of them;
* medians, not means: one preempted step does not move a median.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from .ranks import max_over_ranks


def synchronize(device: torch.device | None) -> None:
    """Wait for queued GPU work; a no-op on CPU, where every op has finished when it returns."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], object], *, steps: int, warmup: int = 2,
               device: torch.device | None = None, barrier: bool = True) -> list[float]:
    """Run ``step`` warmup+steps times; return the last ``steps`` durations in milliseconds."""
    samples = []
    for i in range(warmup + steps):
        _line_up(device, barrier)
        start = time.perf_counter()
        step()
        synchronize(device)
        if i >= warmup:
            samples.append((time.perf_counter() - start) * 1e3)
    return samples


def compare(variants: dict[str, Callable[[], object]], *, rounds: int, steps_per_round: int = 1,
            warmup: int = 2, device: torch.device | None = None, barrier: bool = True,
            shuffle: bool = False,
            progress: Callable[[Iterable[int]], Iterable[int]] | None = None,
            ) -> dict[str, list[float]]:
    """Time several variants interleaved: A B C, A B C, … ``rounds`` times.

    Each variant first runs ``warmup`` untimed steps.  Every rank must pass the same variants
    in the same order (they contain collectives).  Returns the samples (ms) of each variant.
    ``shuffle``: each round runs the variants in a random order drawn from the round's number
    (so the same order on every rank): every variant follows every other about equally often,
    instead of always running right after the same one (a heavy predecessor can leave caches
    cold or a communication thread busy).  ``progress`` wraps the rounds, e.g. in a progress bar.
    """
    for step in variants.values():
        for _ in range(warmup):
            step()
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    rounds_iter = range(rounds) if progress is None else progress(range(rounds))
    for r in rounds_iter:
        order = list(names)
        if shuffle:
            random.Random(r).shuffle(order)
        for name in order:
            samples[name] += time_steps(variants[name], steps=steps_per_round, warmup=0,
                                        device=device, barrier=barrier)
    return samples


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def slowest_rank(value: float) -> float:
    """The largest value over all ranks: a synchronous step is as slow as its slowest rank."""
    if not dist.is_initialized():
        return value
    return float(max_over_ranks(torch.tensor([value], dtype=torch.float64)).item())


def slowest_rank_per_step(samples: dict[str, list[float]]) -> dict[str, list[float]]:
    """Step by step, the slowest rank's time: what a synchronous step really took.

    A collective: every rank calls it with the same names and the same number of samples.
    """
    if not dist.is_initialized():
        return samples
    names = list(samples)
    t = max_over_ranks(torch.tensor([samples[n] for n in names], dtype=torch.float64))
    return {n: row.tolist() for n, row in zip(names, t, strict=True)}


def _line_up(device: torch.device | None, barrier: bool) -> None:
    synchronize(device)
    if barrier and dist.is_initialized():
        dist.barrier()
        synchronize(device)


class Laps:
    """Seconds per named phase, each measured from the end of the one before."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now

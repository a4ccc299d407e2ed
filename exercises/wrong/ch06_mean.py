"""Mistake: idle measured against the mean rank instead of the slowest."""

from exercises.solutions.chapter06_bubbles import common_steps  # noqa: F401


def idle_per_rank(compute_ms):
    idle = [0.0] * len(compute_ms[0])
    for step in compute_ms:
        mean = sum(step) / len(step)
        for rank, ms in enumerate(step):
            idle[rank] += mean - ms
    return idle

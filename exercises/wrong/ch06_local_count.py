"""Mistakes: each rank trusts its own batch count; idle computed from total compute times."""


def idle_per_rank(compute_ms):
    totals = [sum(step[r] for step in compute_ms) for r in range(len(compute_ms[0]))]
    return [max(totals) - t for t in totals]


def common_steps(my_batches):
    return my_batches

"""Mistake: the last, partly filled bucket (the first layers) is dropped."""

from exercises.solutions.chapter04_hooks import ready_order, scale_gradients  # noqa: F401


def assign_buckets(sizes_bytes, cap_bytes):
    buckets, current, size = [], [], 0
    for index in reversed(range(len(sizes_bytes))):
        current.append(index)
        size += sizes_bytes[index]
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets  # forgot: the last bucket

"""Mistakes: the ready order guessed as the reverse definition order; buckets in forward order."""

from exercises.solutions.chapter04_hooks import scale_gradients  # noqa: F401


def ready_order(model, loss):
    loss.backward()
    return [name for name, _ in model.named_parameters()][::-1]


def assign_buckets(sizes_bytes, cap_bytes):
    buckets, current, size = [], [], 0
    for index in range(len(sizes_bytes)):
        current.append(index)
        size += sizes_bytes[index]
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets

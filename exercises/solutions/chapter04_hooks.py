"""Chapter 04 solutions.  `make grade-04 FILE=<this file>`."""

from __future__ import annotations

import torch
from torch import nn


# --8<-- [start:ready_order]
def ready_order(model: nn.Module, loss: torch.Tensor) -> list[str]:
    order = []
    handles = [p.register_post_accumulate_grad_hook(lambda _p, name=name: order.append(name))
               for name, p in model.named_parameters() if p.requires_grad]
    try:
        loss.backward()  # the hooks fire as each .grad is accumulated
    finally:
        for handle in handles:  # a hook left behind would trace every later backward too
            handle.remove()
    return order
# --8<-- [end:ready_order]


# --8<-- [start:assign_buckets]
def assign_buckets(sizes_bytes: list[int], cap_bytes: int) -> list[list[int]]:
    buckets, current, size = [], [], 0
    for index in reversed(range(len(sizes_bytes))):  # the last layer's gradient is ready first
        current.append(index)
        size += sizes_bytes[index]
        if size >= cap_bytes:  # close AFTER adding: a parameter is never split
            buckets.append(current)
            current, size = [], 0
    if current:  # the first layers: a last bucket that never reached the cap
        buckets.append(current)
    return buckets
# --8<-- [end:assign_buckets]


# --8<-- [start:scale_gradients]
def scale_gradients(model: nn.Module, factor: float) -> None:
    def hook(param: nn.Parameter) -> None:  # receives the PARAMETER (chapter 04's trap)
        param.grad.mul_(factor)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
# --8<-- [end:scale_gradients]

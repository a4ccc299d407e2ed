"""Chapter 04 exercises: autograd hooks and buckets.  Grade your work with `make grade-04`."""

from __future__ import annotations

import torch
from torch import nn


def ready_order(model: nn.Module, loss: torch.Tensor) -> list[str]:
    """Exercise 04.1: run ``loss.backward()`` and return the names of ``model``'s parameters
    (as in ``model.named_parameters()``) in the order their gradients became ready.

    Remove every hook you register before returning.
    """
    raise NotImplementedError("exercise 04.1: a post-accumulate-grad hook per parameter")


def assign_buckets(sizes_bytes: list[int], cap_bytes: int) -> list[list[int]]:
    """Exercise 04.2: native DDP's buckets after its rebuild, for parameters of these sizes
    (definition order) whose gradients become ready from the LAST to the first.

    Return lists of parameter indices, bucket 0 first.  The rule of DDP's reducer: walk the
    parameters in ready order (last to first), adding each to the open bucket; a bucket closes
    once it holds ``cap_bytes`` or more.  (All parameters share one dtype and device here.)
    This is not the layout native DDP builds at construction: that one walks the parameters in
    definition order and then reverses the list of buckets.
    """
    raise NotImplementedError("exercise 04.2: fill buckets in reverse, close at the cap")


def scale_gradients(model: nn.Module, factor: float) -> None:
    """Exercise 04.3: register hooks so that, after every backward, each parameter's ``.grad``
    is ``factor`` times what it would have been (the parameters themselves stay unchanged)."""
    raise NotImplementedError("exercise 04.3: a hook that scales each accumulated gradient")

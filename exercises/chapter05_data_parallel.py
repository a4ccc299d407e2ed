"""Chapter 05 exercises: data-parallel training, by hand.

Grade your work with `make grade-05`: your DDP runs next to torch's DistributedDataParallel on 2
and 3 ranks (gloo on CPU) and the gradients are compared, bit for bit at 2 ranks.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist  # noqa: F401 - you will need it
from torch import nn


class DDP(nn.Module):
    """Exercise 05.1: your own DistributedDataParallel.

    ``DDP(module, bucket_cap_mb=25.0)``:

    * ``.module`` is the wrapped module, and ``ddp(x)`` returns ``module(x)``;
    * at construction, the replicas are made equal: every rank ends up with rank 0's parameters
      and buffers (the ranks may start from different random weights);
    * by the time ``loss.backward()`` returns, every parameter's ``.grad`` is the average over
      the ranks of the ranks' gradients (one message per parameter is fine; buckets of about
      ``bucket_cap_mb`` megabytes are better);
    * inside ``with ddp.no_sync():`` backward does not communicate: gradients accumulate
      locally, and the first backward outside averages everything accumulated.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0):
        super().__init__()
        raise NotImplementedError("exercise 05.1: broadcast the weights, average grads in hooks")

    def forward(self, *args, **kwargs):
        raise NotImplementedError("exercise 05.1: pass the call through to the module")

    @contextmanager
    def no_sync(self):
        raise NotImplementedError("exercise 05.1: skip communication inside this block")
        yield


def accumulate_gradients(ddp: nn.Module, micro_batches: list, loss_fn) -> None:
    """Exercise 05.2: gradient accumulation that communicates once.

    ``micro_batches`` is a list of ``(x, y)``; run forward and backward on each so that the
    gradients end up as those of ONE backward over all of them (``loss_fn`` averages over its
    batch, and all micro-batches have the same size), averaged over the ranks, while only the
    last backward communicates (``ddp`` has a ``no_sync()``; it may be native DDP or yours).
    """
    raise NotImplementedError("exercise 05.2: no_sync for all but the last, scale each loss")

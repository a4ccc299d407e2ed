"""Chapter 05 solutions: a DDP of your own.  `make grade-05 FILE=<this file>`.

The simple version first (one all-reduce per parameter, launched from a hook the moment that
parameter's gradient is ready), which is already a correct DDP; then ``bucket_cap_mb`` is put to
use by grouping the parameters into buckets, so that there are few, large messages.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn


# --8<-- [start:ddp]
class DDP(nn.Module):
    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0):
        super().__init__()
        self.module = module
        self.world = dist.get_world_size()
        self.sync = True
        with torch.no_grad():  # every replica starts as rank 0's: parameters AND buffers
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        self.buckets = self._buckets(bucket_cap_mb * 2**20)
        self.pending = {id(b): len(b) for b in self.buckets}
        for bucket in self.buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self._ready_hook(bucket))

    def _buckets(self, cap_bytes: float) -> list[list[nn.Parameter]]:
        """Reverse order: the last layer's gradients are ready first in backward.  Native DDP's
        rule: add the parameter, then close the bucket once it holds the cap or more (a
        parameter is never split, so a bucket can end over the cap)."""
        buckets, bucket, size = [], [], 0
        for p in reversed([p for p in self.module.parameters() if p.requires_grad]):
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= cap_bytes:
                buckets.append(bucket)
                bucket, size = [], 0
        if bucket:  # the last one, under the cap
            buckets.append(bucket)
        return buckets

    def _ready_hook(self, bucket):
        def hook(param):  # runs once param.grad holds this backward's gradient
            if not self.sync:
                return  # no_sync: keep accumulating locally
            self.pending[id(bucket)] -= 1
            if self.pending[id(bucket)] == 0:  # the bucket's last gradient: send it
                self.pending[id(bucket)] = len(bucket)
                self._all_reduce_mean(bucket)
        return hook

    def _all_reduce_mean(self, bucket) -> None:
        flat = torch.cat([p.grad.view(-1) for p in bucket])  # one message per bucket
        dist.all_reduce(flat)
        flat /= self.world
        for p, g in zip(bucket, flat.split([p.numel() for p in bucket]), strict=True):
            p.grad.copy_(g.view_as(p))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        self.sync = False
        try:
            yield
        finally:
            self.sync = True
# --8<-- [end:ddp]
# This version waits for each bucket's all-reduce inside backward; the chapter's BucketedDDP
# launches it asynchronously (async_op=True) and waits only at the end of backward, so the
# messages overlap with the rest of the backward pass.


# --8<-- [start:accumulate]
def accumulate_gradients(ddp: nn.Module, micro_batches: list, loss_fn) -> None:
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        last = i == k - 1
        # the mean over k micro-batches of each micro-batch's mean loss = the whole batch's mean
        if last:
            (loss_fn(ddp(x), y) / k).backward()  # communicates: averages the accumulated sum
        else:
            with ddp.no_sync():
                (loss_fn(ddp(x), y) / k).backward()
# --8<-- [end:accumulate]

"""SyncBatchNorm by hand: BatchNorm statistics over the whole global batch, on CPU too.

BatchNorm normalises with the mean and variance of the batch it sees.  Under data parallelism
each rank sees only its shard, so each rank normalises differently, and with small per-rank
batches the statistics get noisy.  SyncBatchNorm computes them over *all* ranks' samples: one
collective in every forward (the statistics) and one in every backward (their gradients), in
each BatchNorm layer.  Those are sync points inside the model: a late rank stalls the others
in the middle of the forward pass, before any gradient exists to overlap with.

``torch.nn.SyncBatchNorm`` only runs on GPUs (it refuses CPU tensors, and native DDP refuses
CPU modules that contain it), so the CPU chapters use this one.  The maths is the same; it
all-reduces per-channel sums where the native one all-gathers per-rank means and variances.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .run.timeline import Timeline


def _span(timeline: Timeline | None, name: str):
    return timeline.span(name, "comm") if timeline is not None else nullcontext()


# --8<-- [start:forward]
class _SyncBatchNormFunction(torch.autograd.Function):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, with mean and var over every rank."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group,
                timeline):
        dims = [d for d in range(x.dim()) if d != 1]           # every dim but the channels
        shape = [1, -1] + [1] * (x.dim() - 2)                  # broadcast per channel
        # Sync point 1: per-channel sum, sum of squares and count over all ranks (float64:
        # the variance is a difference of two large sums).
        count = torch.full((1,), x.numel() // x.size(1), dtype=torch.float64, device=x.device)
        stats = torch.cat([x.sum(dims, dtype=torch.float64),
                           (x * x).sum(dims, dtype=torch.float64), count])
        with _span(timeline, "SyncBN statistics"):
            dist.all_reduce(stats, group=group)
        total, squares, n = stats[:x.size(1)], stats[x.size(1):-1], stats[-1]
        mean = total / n
        var = squares / n - mean * mean                        # biased: what BatchNorm divides by
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:                           # unbiased, as nn.BatchNorm keeps it
            running_mean.lerp_(mean.to(running_mean.dtype), momentum)
            running_var.lerp_((var * n / (n - 1)).to(running_var.dtype), momentum)

        xhat = (x - mean.to(x.dtype).view(shape)) * invstd.to(x.dtype).view(shape)
        ctx.save_for_backward(xhat, weight, invstd.to(x.dtype), n.to(x.dtype))
        ctx.dims, ctx.shape, ctx.group, ctx.timeline = dims, shape, group, timeline
        return xhat * weight.view(shape) + bias.view(shape)
# --8<-- [end:forward]

    # --8<-- [start:backward]
    @staticmethod
    def backward(ctx, grad_out):
        xhat, weight, invstd, n = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        grad_bias = grad_out.sum(dims)                         # local: DDP averages them later
        grad_weight = (grad_out * xhat).sum(dims)
        # Sync point 2: every sample moved the shared mean and variance, so every rank's
        # input gradient depends on the other ranks' output gradients, through two sums.
        sums = torch.cat([grad_bias, grad_weight])
        with _span(ctx.timeline, "SyncBN gradient sums"):
            dist.all_reduce(sums, group=ctx.group)
        mean_dy, mean_dy_xhat = (sums / n).view(2, -1)
        grad_x = (weight * invstd).view(shape) * (
            grad_out - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape))
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None
    # --8<-- [end:backward]


class SyncBatchNorm(_BatchNorm):
    """Drop-in BatchNorm (1d/2d/3d) whose training statistics span every rank of ``group``.

    In eval mode, or without a process group, it is plain BatchNorm with its running
    statistics.  Needs ``affine=True`` and a float ``momentum`` (the defaults).
    ``timeline``: record each of its collectives as a ``comm`` span.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 process_group: dist.ProcessGroup | None = None,
                 timeline: Timeline | None = None, **kwargs):
        super().__init__(num_features, eps, momentum, **kwargs)
        if not self.affine or momentum is None:
            raise ValueError("ddplab.SyncBatchNorm needs affine=True and a float momentum")
        self.process_group = process_group
        self.timeline = timeline

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (batch, channels, ...), got {x.dim()}D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and dist.is_initialized()
                and dist.get_world_size(self.process_group) > 1):
            return super().forward(x)
        self._check_input_dim(x)
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        group = self.process_group or dist.group.WORLD
        return _SyncBatchNormFunction.apply(x, self.weight, self.bias, self.running_mean,
                                            self.running_var, self.eps, self.momentum, group,
                                            self.timeline)


def convert_sync_batchnorm(module: nn.Module, process_group=None,
                           timeline: Timeline | None = None) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` by a SyncBatchNorm, keeping its state.

    On GPUs use ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``, the native equivalent.
    """
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        sync = SyncBatchNorm(module.num_features, module.eps, module.momentum, process_group,
                             timeline, affine=module.affine,
                             track_running_stats=module.track_running_stats)
        sync.load_state_dict(module.state_dict())
        sync.train(module.training)
        return sync.to(next(module.parameters()).device)
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, process_group, timeline))
    return module

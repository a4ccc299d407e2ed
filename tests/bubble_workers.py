"""Functions the chapter 06 module tests run on every rank (importable, as mp.spawn requires)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import ddplab
from ddplab import syncbn
from ddplab.timing import slowest_rank


def _shard_sizes(world_size: int) -> list[int]:
    return [3 + 2 * r for r in range(world_size)]  # unequal on purpose: 3, 5, 7, ...


def syncbn_against_full_batch(ctx: ddplab.RankContext, args) -> dict:
    """ddplab.SyncBatchNorm on uneven shards against nn.BatchNorm on the whole batch.

    Loss: sum over samples of y * w (fixed random w), so the whole-batch loss is the sum of
    the ranks' losses; then the input gradient of each shard, the *sum* over ranks of the
    parameter gradients, the outputs, the running statistics and eval mode must all match.
    """
    sizes = _shard_sizes(ctx.world_size)
    start = sum(sizes[:ctx.rank])
    mine = slice(start, start + sizes[ctx.rank])
    diffs = {}
    for name, make, extra in (("1d", nn.BatchNorm1d, ()), ("2d", nn.BatchNorm2d, (5, 4))):
        torch.manual_seed(0)
        reference = make(6)
        with torch.no_grad():
            reference.weight.uniform_(0.5, 1.5)
            reference.bias.uniform_(-0.5, 0.5)
        sync = syncbn.convert_sync_batchnorm(copy.deepcopy(reference))
        g = torch.Generator().manual_seed(1)
        full = torch.randn((sum(sizes), 6, *extra), generator=g) * 3 + 1
        weights = torch.randn(full.shape, generator=g)

        x = full[mine].clone().requires_grad_()
        y = sync(x)
        (y * weights[mine]).sum().backward()
        xf = full.clone().requires_grad_()
        yf = reference(xf)
        (yf * weights).sum().backward()

        param_grads = torch.cat([sync.weight.grad, sync.bias.grad])
        dist.all_reduce(param_grads)
        sync.eval()
        reference.eval()
        checks = {
            "output": (y - yf[mine]).abs().max(),
            "input_grad": (x.grad - xf.grad[mine]).abs().max(),
            "param_grad_sum": (param_grads - torch.cat([reference.weight.grad,
                                                        reference.bias.grad])).abs().max(),
            "running_mean": (sync.running_mean - reference.running_mean).abs().max(),
            "running_var": (sync.running_var - reference.running_var).abs().max(),
            "eval_output": (sync(full[mine]) - reference(full[mine])).abs().max(),
        }
        diffs[name] = {k: slowest_rank(v.item()) for k, v in checks.items()}
        diffs[name]["is_sync"] = isinstance(sync, syncbn.SyncBatchNorm)
    return diffs

"""Functions the chapter 06 module tests run on every rank (importable, as mp.spawn requires)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import ddplab
from ddplab import syncbn
from ddplab.run.timing import slowest_rank


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


def hook_against_built_in(ctx: ddplab.RankContext, args) -> dict:
    """One backward of the same MLP and batch under native DDP, once with its built-in
    averaging and once with ``stragglers.timed_allreduce_hook``; plus, for the bound, the sum
    over ranks of |local gradient| of every element (one plain backward, no DDP)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab import stragglers
    from ddplab.run.timeline import Timeline

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    g = torch.Generator().manual_seed(100 + ctx.rank)   # each rank its own batch
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    grads = {}
    for name in ("built_in", "hook"):
        model = DDP(mlp(), bucket_cap_mb=0.01)   # several buckets
        if name == "hook":
            model.register_comm_hook(None, stragglers.timed_allreduce_hook(Timeline(ctx.rank)))
        for _ in range(2):   # the second step runs on the rebuilt buckets
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
        grads[name] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    local = mlp()
    nn.functional.cross_entropy(local(x), y).backward()
    abs_sum = torch.cat([p.grad.reshape(-1) for p in local.parameters()]).abs()
    dist.all_reduce(abs_sum)
    diff = (grads["built_in"] - grads["hook"]).abs()
    return {"max_abs_diff": slowest_rank(diff.max().item()),
            "max_ratio_to_bound": slowest_rank((diff / abs_sum.clamp_min(1e-30)).max().item())}


def buffers_with_forward_sync_off(ctx: ddplab.RankContext, args) -> dict:
    """DDP built with ``stragglers.no_forward_buffer_sync()``: warnings raised, buffers equal
    after construction (the init sync stays), and no broadcast in a training step."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab import stragglers

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(float(ctx.rank + 1))   # different on every rank
    kwargs = stragglers.no_forward_buffer_sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = DDP(model, **kwargs)
    if "broadcast_buffers" in kwargs:
        stragglers.broadcast_buffers_once(ddp.module)
    mean = ddp.module[1].running_mean.clone()
    rank0 = mean.clone()
    dist.broadcast(rank0, 0)
    x = torch.randn(8, 4)
    step = stragglers.count_collectives(lambda: ddp(x).sum().backward())
    return {"warnings": [str(w.message) for w in caught], "kwargs": kwargs,
            "buffers_equal_after_init": bool(torch.equal(mean, rank0)),
            "mean_after_init": mean.tolist(), "collectives": dict(step)}

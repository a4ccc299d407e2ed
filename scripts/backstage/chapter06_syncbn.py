"""BatchNorm against SyncBatchNorm under native DDP: what the sync points inside a model cost.

SyncBatchNorm adds collectives to the forward and backward passes (scripts/ddplab/syncbn.py
explains them).  ``batchnorm_vs_syncbn`` measures the step time of both, the collectives each
step issues (with DDP's per-forward buffer broadcast on and off), the time spent inside
SyncBatchNorm's collectives, and checks the gradients against one process that sees the whole
batch; ``syncbn_timeline`` records where an on-time rank waits for a late one.  Both take the
chapter's ``train_step`` (one step, each phase a span on a timeline).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import stragglers, syncbn
from ddplab.run import timeline
from ddplab.run.timing import compare, median, slowest_rank

from .chapter06_workbench import cnn, native_ddp, rank_batch, record_timeline, sgd


def sync_batchnorm(model: nn.Module, device: torch.device, tl: timeline.Timeline | None):
    """Native SyncBatchNorm on GPUs; on CPU ddplab's, which can also time its collectives
    (the native one refuses CPU tensors)."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return syncbn.convert_sync_batchnorm(model, timeline=tl)


def native_syncbn_on_cpu() -> str | None:
    """What native DDP says when handed a CPU model with torch.nn.SyncBatchNorm in it."""
    if dist.get_backend() != "gloo":
        return None
    try:
        DDP(nn.SyncBatchNorm.convert_sync_batchnorm(cnn()))
    except ValueError as err:
        return f"{type(err).__name__}: {err}"
    return None


def diff_to_full_batch(ctx, model: DDP, x, y) -> float:
    """Largest gradient difference between DDP on shards and one process on the whole batch.

    SyncBatchNorm must match it to rounding; plain BatchNorm normalises each shard with its
    own statistics, so it does not.
    """
    reference = cnn().to(ctx.device)                 # plain BatchNorm, one process, all data
    reference.load_state_dict(model.module.state_dict())
    xs = [torch.empty_like(x) for _ in range(ctx.world_size)]
    ys = [torch.empty_like(y) for _ in range(ctx.world_size)]
    dist.all_gather(xs, x)
    dist.all_gather(ys, y)
    F.cross_entropy(reference(torch.cat(xs)), torch.cat(ys)).backward()
    F.cross_entropy(model(x), y).backward()          # DDP: mean over my shard, then averaged
    diff = max((a.grad - b.grad).abs().max().item()
               for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    model.zero_grad()
    return slowest_rank(diff)                        # the worst rank's difference


def bn_models(ctx, tl: timeline.Timeline | None) -> dict[str, DDP]:
    models = {}
    for name in ("bn", "syncbn"):
        torch.manual_seed(ctx.seed)
        net = cnn() if name == "bn" else sync_batchnorm(cnn(), ctx.device, tl)
        models[name] = native_ddp(net, ctx)
    return models


def batchnorm_vs_syncbn(ctx, rounds: int, train_step) -> dict:
    """Step times, collectives per step, time inside SyncBatchNorm's collectives, and the
    gradient check against one process that sees the whole batch."""
    x, y = rank_batch(ctx, (16, 3, 32, 32), salt=1)
    tl = timeline.Timeline(ctx.rank, device=ctx.device)
    models = bn_models(ctx, tl)
    quiet = timeline.Timeline(ctx.rank, enabled=False)
    opts = {name: sgd(m) for name, m in models.items()}
    diffs = {name: diff_to_full_batch(ctx, m, x, y) for name, m in models.items()}

    def step(name):
        return lambda: train_step(models[name], opts[name], x, y, quiet)
    samples = compare({name: step(name) for name in models}, rounds=rounds, warmup=3,
                      device=ctx.device)
    in_syncbn = []
    for _ in range(rounds):
        dist.barrier()
        tl.start_clock()
        step("syncbn")()
        in_syncbn.append(sum(e.duration_ms for e in tl.events))
    counts = {k: stragglers.count_collectives(step(k)) for k in models}
    counts["syncbn_forward_sync_off"] = collectives_without_buffer_sync(ctx, x, y, train_step)
    return {"step_time_ms": {k: median(v) for k, v in samples.items()},
            "syncbn_collectives_ms": median(in_syncbn) if tl.events else None,
            "collectives_per_step": counts,
            "buffer_sync_off_argument": stragglers.no_forward_buffer_sync(),
            "broadcasts_per_step": {"default": counts["syncbn"].get("broadcast", 0),
                                    "forward_sync_off": counts["syncbn_forward_sync_off"].get(
                                        "broadcast", 0)},
            "max_abs_grad_diff_vs_full_batch": diffs,
            "implementation": ("torch.nn.SyncBatchNorm" if ctx.device.type == "cuda"
                               else "ddplab.syncbn.SyncBatchNorm"),
            "native_on_cpu_error": native_syncbn_on_cpu()}


def collectives_without_buffer_sync(ctx, x, y, train_step) -> dict:
    """The SyncBatchNorm model with DDP's per-forward buffer broadcast turned off."""
    torch.manual_seed(ctx.seed)
    net = sync_batchnorm(cnn(), ctx.device, None)
    off = stragglers.no_forward_buffer_sync()
    model = native_ddp(net, ctx, **off)
    if "broadcast_buffers" in off:   # torch < 2.13: that also skipped the sync at construction
        stragglers.broadcast_buffers_once(model.module)
    opt = sgd(model)
    quiet = timeline.Timeline(ctx.rank, enabled=False)
    for _ in range(2):   # past the first step, whose end also broadcasts the rebuilt buckets
        train_step(model, opt, x, y, quiet)
    return stragglers.count_collectives(lambda: train_step(model, opt, x, y, quiet))


def syncbn_timeline(ctx, late_ms: float, train_step, steps: int = 2):
    """SyncBatchNorm under native DDP with one late rank: where does the on-time rank wait?"""
    tl = timeline.Timeline(ctx.rank, device=ctx.device)
    model = bn_models(ctx, tl)["syncbn"]
    model.register_comm_hook(None, stragglers.timed_allreduce_hook(tl))
    stragglers.time_ddp_pre_forward(model, tl)
    x, y = rank_batch(ctx, (16, 3, 32, 32), salt=1)
    return record_timeline(ctx, model, tl, x, y, train_step, steps=steps, late_ms=late_ms)

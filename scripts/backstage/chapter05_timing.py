"""Timing several data-parallel variants of one model fairly, side by side.

Chapter 05 times a training step of each variant (no communication, NaiveDDP, BucketedDDP,
native DDP) the way ``ddplab.run.timing`` explains: warm-up first, then rounds in which every
variant takes one step, in a shuffled order, each step as slow as its slowest rank.  Around that:

* ``rank_batches``: a few batches of this rank's shard, already on the device;
* ``timed_sync``: NaiveDDP's communication timed on its own (it is a separate call);
* ``native_bucket_bytes``: native DDP's bucket sizes (a private API: None if it changed);
* ``allreduce_ms``: one all-reduce of a given size, to completion;
* ``why_naive_is_slower``: NaiveDDP's many small messages against one big one (collective).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from ddplab.naive_ddp import NaiveDDP
from ddplab.run import timing
from ddplab.run.ranks import progress


def rank_batches(train_set, ctx, batch: int, count: int) -> list[tuple[torch.Tensor, ...]]:
    """``count`` different batches of this rank's shard, already on the device."""
    sampler = DistributedSampler(train_set, num_replicas=ctx.world_size, rank=ctx.rank,
                                 shuffle=True, seed=ctx.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=batch, sampler=sampler, drop_last=True)
    out = []
    for x, y in loader:
        out.append((x.to(ctx.device), y.to(ctx.device)))
        if len(out) == count:
            break
    return out


def timed_sync(naive: NaiveDDP, record: list[float], device: torch.device) -> None:
    """Time NaiveDDP's communication on its own (it is a separate call after backward).

    On nccl, ``all_reduce`` returns once the collective is queued on the GPU, not when it is
    done: without the synchronize calls this would time the launches.  On CPU they do nothing.
    """
    sync = naive.sync_gradients

    def timed():
        timing.synchronize(device)  # backward's queued GPU work is not part of the sync
        start = time.perf_counter()
        sync()
        timing.synchronize(device)  # until the last all-reduce has really finished
        record.append((time.perf_counter() - start) * 1e3)
    naive.sync_gradients = timed


def time_variants(ctx, models: dict[str, nn.Module], batches, stepper, rounds: int,
                  desc: str) -> tuple[dict[str, list[float]], dict]:
    """Per-round step times (ms, the slowest rank's) of each variant, interleaved and shuffled.

    ``models``: the variants by name ("naive", "bucketed" and "native" get their all-reduces
    described too); ``stepper(model, batches)``: a zero-argument training step that cycles
    through ``batches``.
    """
    naive_sync_ms: list[float] = []
    if "naive" in models:
        timed_sync(models["naive"], naive_sync_ms, ctx.device)
    steps = {kind: stepper(m, batches) for kind, m in models.items()}
    timing.compare(steps, rounds=0, warmup=3, device=ctx.device)  # warm-up only
    naive_sync_ms.clear()
    samples = timing.compare(steps, rounds=rounds, warmup=0, device=ctx.device, shuffle=True,
                             progress=lambda r: progress(r, ctx, desc))
    per_round = timing.slowest_rank_per_step(samples)  # a step is as slow as its slowest rank
    info = {"buckets": {}}
    if "naive" in models:
        info["naive_sync_ms"] = statistics.median(naive_sync_ms)
        info["naive_allreduce_calls"] = sum(p.requires_grad for p in models["naive"].parameters())
    if "bucketed" in models:
        info["buckets"]["bucketed"] = [b.nbytes for b in models["bucketed"].buckets]
    if "native" in models:
        info["buckets"]["native"] = native_bucket_bytes(models["native"])
    return per_round, info


def native_bucket_bytes(ddp: DistributedDataParallel) -> list[int] | None:
    """Native DDP's bucket sizes now (after the first iteration: the rebuilt ones)."""
    try:  # a private API, which may change: then the page says "unknown"
        buckets = ddp.reducer._get_zeros_like_grad_buckets()
        return [b.buffer().numel() * b.buffer().element_size() for b in buckets]
    except (AttributeError, RuntimeError):
        return None


def allreduce_ms(numel: int, device: torch.device, repeats: int) -> tuple[float, float]:
    """Median and mean time of one all-reduce of ``numel`` floats (to completion, on a GPU
    too).  The mean counts the calls that stalled; the median does not."""
    t = torch.zeros(numel, device=device)
    samples = timing.time_steps(lambda: dist.all_reduce(t), steps=repeats, warmup=2,
                                device=device)
    return (timing.slowest_rank(statistics.median(samples)),
            timing.slowest_rank(statistics.mean(samples)))


def why_naive_is_slower(ctx, info: dict, model: nn.Module) -> dict:
    """NaiveDDP's all-reduce calls and sync time (``info`` from ``time_variants``) against one
    tiny all-reduce and one of the whole gradient.  Collective: every rank calls it."""
    grad_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    whole, _ = allreduce_ms(grad_numel, ctx.device, 5 if ctx.quick else 20)
    small, small_mean = allreduce_ms(1, ctx.device, 30 if ctx.quick else 100)
    return {
        "allreduce_calls": {"naive": info["naive_allreduce_calls"],
                            "bucketed": len(info["buckets"]["bucketed"]),
                            "native": len(info["buckets"]["native"] or [])},
        "bucket_bytes": info["buckets"],
        "naive_sync_ms": info["naive_sync_ms"],
        "small_allreduce_ms": small,
        "small_allreduce_mean_ms": small_mean,  # stalled calls included
        "whole_gradient_allreduce_ms": whole,
        "sync_vs_one_message": info["naive_sync_ms"] / whole,
        "gradient_mib": grad_numel * 4 / 2**20,
    }

"""Functions chapter 02's tests run on every rank (importable, as mp.spawn requires)."""

from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist
from conftest import REPO


def chapter02():
    spec = importlib.util.spec_from_file_location(
        "chapter02_collectives", REPO / "scripts" / "chapter02_collectives.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fallback_matches_reduce_scatter(ctx, args) -> bool:
    """The fallback for an old gloo gives every rank what dist.reduce_scatter gives it."""
    ch02 = chapter02()
    n = ctx.world_size
    pieces = list(torch.arange(3.0 * n).add(10 * ctx.rank).chunk(n))
    real, fallback = torch.empty(3), torch.empty(3)
    dist.reduce_scatter(real, [p.clone() for p in pieces])
    ch02.reduce_scatter_by_all_reduce(fallback, [p.clone() for p in pieces])
    same = torch.tensor([float(torch.equal(real, fallback))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item()) and not torch.equal(real, torch.zeros(3))


def hooked_buckets_vs_native(ctx, args) -> dict:
    """Chapter 04's HookedBuckets against native DDP on the same model and batch."""
    import copy

    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from ddplab.hooked_buckets import HookedBuckets

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 3))
    native = DistributedDataParallel(copy.deepcopy(model))
    hooked = HookedBuckets(list(model.parameters()), cap_bytes=1_000)  # three buckets
    torch.manual_seed(100 + ctx.rank)  # a different batch on every rank
    x = torch.randn(16, 8)
    results = {"buckets": len(hooked.buckets), "launch_logs": []}
    for _ in range(2):  # a second backward: the state is reset between passes
        for m in (model, native):
            m.zero_grad()
            m(x).square().mean().backward()
        results["launch_logs"].append(list(hooked.launch_log))
        hooked.launch_log.clear()
    mine = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    theirs = torch.cat([p.grad.reshape(-1) for p in native.parameters()])
    results["max_abs_diff"] = (mine - theirs).abs().max().item()
    results["max_abs"] = theirs.abs().max().item()
    # The first bucket holds the last layer: reverse order.
    results["first_bucket_is_last_layer"] = hooked.buckets[0][0] is list(model.parameters())[-1]
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, results)
    return everyone

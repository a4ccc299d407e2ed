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

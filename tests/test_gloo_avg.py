"""Reduce-scatter with ReduceOp.AVG on gloo averages on the installed torch.

pytorch#162338 (September 2025): gloo's reduce-scatter ignored the op and summed, silently;
fixed by pytorch#171458 (merged December 2025).  Page 02 relies on this torch being fixed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from conftest import launch_forked

import ddplab


def avg_reduce_scatters(ctx, args) -> dict:
    n, rank = ctx.world_size, ctx.rank
    pieces = [torch.full((3,), float((rank + 1) * (i + 1))) for i in range(n)]
    want = torch.full((3,), sum(r + 1 for r in range(n)) * (rank + 1) / n)
    out_list, out_flat = torch.empty(3), torch.empty(3)
    dist.reduce_scatter(out_list, pieces, op=dist.ReduceOp.AVG)
    dist.reduce_scatter_tensor(out_flat, torch.cat(pieces), op=dist.ReduceOp.AVG)
    return {"list": torch.equal(out_list, want), "flat": torch.equal(out_flat, want),
            "got": out_list.tolist(), "want": want.tolist()}


def test_gloo_reduce_scatter_avg_averages(tmp_path):
    args = ddplab.parse_chapter_args(ddplab.chapter_parser("test"),
                                     ["--world-size", "3", "--out", str(tmp_path)])
    result = launch_forked(avg_reduce_scatters, args).result
    assert result["list"] and result["flat"], result

"""Chapter 06's workbench: the models, each rank's batch, a recorded window of steps.

The chapter measures where ranks wait; these are the pieces every one of its measurements
shares:

* ``mlp`` (no buffers: the gradient all-reduce is a step's only collective) and ``cnn`` (three
  BatchNorm layers), ``rank_batch`` (each rank its own data), ``native_ddp`` and ``wrapped``
  (native DDP timed by a comm hook, or BucketedDDP, which times itself), ``sgd``;
* ``record_timeline``: a window of consecutive steps of the chapter's ``train_step`` (each
  phase a span), every rank's events gathered on rank 0;
* ``profiler_traces``: on a GPU, torch.profiler's trace of a few native DDP steps, every rank's;
* ``write_traces``: the Chrome/Perfetto traces of a run.
"""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ddplab import stragglers
from ddplab.bucketed_ddp import BucketedDDP
from ddplab.run import models, ranks, timeline
from ddplab.run.ranks import RankContext

BUCKET_MB = 0.25          # small buckets: several all-reduces per step, visible on a timeline


def mlp(width: int = 256, depth: int = 4) -> nn.Sequential:
    """No buffers, no BatchNorm: the gradient all-reduce is the only collective in a step."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def cnn() -> nn.Sequential:
    """A small convolutional net with three BatchNorm layers."""
    def block(c_in: int, c_out: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out),
                nn.ReLU()]
    return nn.Sequential(*block(3, 16, 1), *block(16, 32, 2), *block(32, 32, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def rank_batch(ctx: RankContext, shape: tuple[int, ...], salt: int = 0):
    """This rank's own batch (each rank sees different data, as in real training)."""
    g = torch.Generator().manual_seed(1000 * (salt + 1) + ctx.rank)
    x = torch.randn(shape, generator=g)
    y = torch.randint(0, 10, (shape[0],), generator=g)
    return x.to(ctx.device), y.to(ctx.device)


# Chapter 06's settings of the shared helpers: its bucket size, plain SGD at lr 0.01.
native_ddp = partial(ranks.native_ddp, bucket_cap_mb=BUCKET_MB)
sgd = partial(models.sgd, lr=0.01)


def wrapped(kind: str, ctx: RankContext, tl: timeline.Timeline):
    """An MLP wrapped by native DDP (timed by a comm hook) or by BucketedDDP (times itself)."""
    torch.manual_seed(ctx.seed)
    model = mlp().to(ctx.device)
    if kind == "bucketed":
        return BucketedDDP(model, bucket_cap_mb=BUCKET_MB, timeline=tl)
    ddp = native_ddp(model, ctx)
    ddp.register_comm_hook(None, stragglers.timed_allreduce_hook(tl))
    return ddp


def record_timeline(ctx, model: nn.Module, tl: timeline.Timeline, x, y, train_step, *, steps: int,
                    late_ms: float = 0.0, windows: int = 3) -> list[timeline.Event] | None:
    """A few consecutive steps on one shared clock, all ranks' events on rank 0.

    Other processes share a small machine's cores, and one of them can stall a step; so we
    record ``windows`` runs of ``steps`` steps and keep the one of median length.
    """
    opt = sgd(model)
    for _ in range(3):  # warm-up: first steps allocate, and native DDP rebuilds its buckets
        train_step(model, opt, x, y, tl, late_ms)
    recorded = []
    for _ in range(windows):
        dist.barrier()
        tl.start_clock()
        for _ in range(steps):
            train_step(model, opt, x, y, tl, late_ms)
        recorded.append(timeline.gather_events(tl))
    if not ctx.is_main:
        return None
    return sorted(recorded, key=lambda events: max(e.end_ms for e in events))[windows // 2]


def profiler_traces(ctx, train_step, steps: int = 2) -> list[str] | None:
    """GPU only: torch.profiler's own trace of native DDP steps (CUDA kernels, NCCL included),
    every rank's, gathered on every rank (a collective on a GPU).

    On a GPU the host clock shows when work was *launched*; the profiler shows when it ran.
    """
    if ctx.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    tl = timeline.Timeline(ctx.rank, enabled=False)
    model = wrapped("native", ctx, tl)
    opt = sgd(model)
    x, y = rank_batch(ctx, (64, 256))
    for _ in range(3):
        train_step(model, opt, x, y, tl)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            train_step(model, opt, x, y, tl)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = path.read_text()
    traces = [None] * ctx.world_size
    dist.all_gather_object(traces, trace)
    return traces


def traces(result: dict) -> dict[str, list | str]:
    """The run's trace files by name: Chrome/Perfetto events, and on GPUs the profiler's text."""
    def with_idle(events):
        return events + stragglers.idle_events(events)
    files = {"trace_native_ddp.json": with_idle(result["timelines"]["native"]),
             "trace_bucketed_ddp.json": result["timelines"]["bucketed"],
             "trace_straggler.json": with_idle(result["bubble"])}
    for rank, trace in enumerate(result.get("profiler_traces", [])):
        files[f"profiler_rank{rank}.json"] = trace
    return files


def write_traces(out: Path, result: dict) -> list[str]:
    files = traces(result)
    for name, trace in files.items():
        if isinstance(trace, str):
            (out / name).write_text(trace)
        else:
            timeline.write_chrome_trace(out / name, trace)
    return list(files)

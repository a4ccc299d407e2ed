"""Sharding's benchmark (``make bench``): ours against native, step time and peak memory.

FullyShardedDP against ``fully_shard`` (step time and peak memory) and ShardedOptimizer against
``ZeroRedundancyOptimizer`` (step time), as ratios.  Each round times one step of every variant
in turn, between barriers, the order reversed every other round; the ratio is taken within each
round and the median reported.  A benchmark on the machine it runs on, recorded, never asserted
by a test.

Peak memory is taken two ways.  On the gloo ranks (``peak_ratio_per_rank``) the profiler misses
a free that happens on gloo's worker thread (it records memory only on the thread it profiles),
so a run can read one message high, at random, for either side.  ``fake_group_peaks`` takes it
where nothing runs on another thread: one process plays rank 0 on a fake process group, whose
collectives move no data and return at once, so every allocation and every free is seen and
the same step peaks at the same bytes on every run.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from ddplab.fsdp import FullyShardedDP
from ddplab.sharded_optimizer import ShardedOptimizer

from .chapter11_probe import profiler_peak_bytes

PAIRS = {"fsdp": ("fsdp_ours", "fully_shard"), "zero1": ("zero1_ours", "zero1_native")}
ROUNDS, WARM_UP = 20, 3
FAKE_GROUP_STEPS = 3  # from the second step on, the optimizer's state is there too


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 1000), nn.ReLU(), nn.LayerNorm(1000),
                         nn.Linear(1000, 700), nn.ReLU(), nn.Linear(700, 10))


def build(kind: str, device: torch.device):
    model = make_model().to(device)
    if kind in ("fsdp_ours", "fully_shard"):
        if kind == "fsdp_ours":
            model = FullyShardedDP(model)
        else:
            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
            for layer in model.children():
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh)
            model = fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    model = DistributedDataParallel(model)
    sharded = ShardedOptimizer if kind == "zero1_ours" else ZeroRedundancyOptimizer
    return model, sharded(model.parameters(), torch.optim.AdamW, lr=1e-3)


def stepper(model, optimizer, x, y):
    def step():
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return step


def bench_worker(ctx, args) -> dict | None:
    g = torch.Generator().manual_seed(ctx.rank)
    x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
    kinds = [k for pair in PAIRS.values() for k in pair]
    steps = {k: stepper(*build(k, ctx.device), x.to(ctx.device), y.to(ctx.device))
             for k in kinds}
    for step in steps.values():
        for _ in range(WARM_UP):
            step()
    times = {k: [] for k in kinds}
    for i in range(ROUNDS):
        for kind in kinds if i % 2 == 0 else reversed(kinds):
            dist.barrier()
            start = time.perf_counter()
            steps[kind]()
            times[kind].append(time.perf_counter() - start)
    peaks = {k: profiler_peak_bytes(steps[k], ctx.device.type) for k in PAIRS["fsdp"]}
    peak_ratio = [None] * ctx.world_size
    dist.all_gather_object(peak_ratio, peaks["fsdp_ours"] / peaks["fully_shard"])
    out = {"rounds": ROUNDS, "median_step_ms": {k: 1e3 * statistics.median(v)
                                                for k, v in times.items()},
           "peak_ratio_per_rank": peak_ratio}
    for name, (ours, native) in PAIRS.items():
        out[f"{name}_step_ratio"] = statistics.median(
            a / b for a, b in zip(times[ours], times[native], strict=True))
    return out if ctx.is_main else None


def fake_group_peaks(world: int = 2, rank: int = 0,
                     steps: int = FAKE_GROUP_STEPS) -> dict[str, list[int]]:
    """The profiler's peak while each FSDP is built and takes ``steps`` steps (from the second
    on, the optimizer's state is there too), twice each, as one rank of a fake process group.
    Run it in a fresh process: it initialises the default group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)

        def train(kind):
            step = stepper(*build(kind, torch.device("cpu")), x, y)
            for _ in range(steps):
                step()

        def measured(kind):
            gc.collect()  # a wrapped model is a reference cycle: freed now, not in sight
            return profiler_peak_bytes(lambda: train(kind))

        return {kind: [measured(kind) for _ in range(2)] for kind in PAIRS["fsdp"]}
    finally:
        dist.destroy_process_group()

"""Bugs that raise nothing: training runs, and only a number measured next to it gives them away.

Same convention as ``ddp_errors.py``.  Each function returns ``{"giveaway": number, "healthy":
bool, "text": "what the number means"}``; ``healthy`` is the check a careful engineer would add.
"""

from __future__ import annotations

import time
from contextlib import nullcontext, suppress

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from .ddp_errors import batch, mlp

EPOCHS = 3


def repeated_orders(orders: list[list[int]]) -> dict:
    repeats = sum(order == orders[0] for order in orders[1:])
    return {"giveaway": repeats, "healthy": repeats == 0,
            "text": f"{repeats} of {len(orders) - 1} later epochs repeat epoch 0's order"}


def sampler_set_epoch_broken(ctx, group, scratch):
    sampler = DistributedSampler(range(64), shuffle=True, seed=ctx.seed)
    orders = []
    for epoch in range(EPOCHS):  # noqa: B007 (ruff sees it: epoch is never used)
        orders.append(list(sampler))  # the order this rank trains on in this epoch
    return repeated_orders(orders)


def sampler_set_epoch_fixed(ctx, group, scratch):
    sampler = DistributedSampler(range(64), shuffle=True, seed=ctx.seed)
    orders = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)  # the shuffle is seeded with seed + epoch
        orders.append(list(sampler))  # the order this rank trains on in this epoch
    return repeated_orders(orders)


def same_across_ranks(values: torch.Tensor) -> dict:
    everyone = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, values)
    same = torch.stack([v == everyone[0] for v in everyone]).all(0).float().mean().item()
    return {"giveaway": same, "healthy": same < 0.5,
            "text": f"{same:.0%} of the random crop scales are the same on every rank"}


def same_augmentation_broken(ctx, group, scratch):
    torch.manual_seed(ctx.seed)  # the same seed everywhere: identical replicas (good)...
    mlp()  # this rank's replica
    scales = torch.empty(64).uniform_(0.5, 1.0)  # ...and identical "random" crops (bad)
    return same_across_ranks(scales)


def same_augmentation_fixed(ctx, group, scratch):
    torch.manual_seed(ctx.seed)  # the same seed everywhere: identical replicas
    mlp()  # this rank's replica
    data_rng = torch.Generator().manual_seed(ctx.seed + ctx.rank)  # data: one stream per rank
    scales = torch.empty(64).uniform_(0.5, 1.0, generator=data_rng)
    return same_across_ranks(scales)


def ranks_on_disk(scratch, names: list[str]) -> dict:
    """Whose state can be read back from the files (each rank saved its own)."""
    dist.barrier()
    found = set()
    for name in names:
        with suppress(Exception):  # a file two ranks wrote at once can be torn
            found.add(torch.load(scratch / name)["rank"])
    world = dist.get_world_size()
    dist.barrier()  # everyone has read before anyone moves on
    return {"giveaway": len(found), "healthy": len(found) == world,
            "text": f"the state of {len(found)} of {world} ranks can be read back"}


def every_rank_saves_broken(ctx, group, scratch):
    state = {"rank": ctx.rank, "rng": torch.get_rng_state(), "batches_seen": 100 + ctx.rank}
    torch.save(state, scratch / "resume.pt")  # every rank, one path: the last writer wins
    return ranks_on_disk(scratch, ["resume.pt"])


def every_rank_saves_fixed(ctx, group, scratch):
    state = {"rank": ctx.rank, "rng": torch.get_rng_state(), "batches_seen": 100 + ctx.rank}
    torch.save(state, scratch / f"resume_rank{ctx.rank}.pt")  # rank-specific state: own file
    return ranks_on_disk(scratch, [f"resume_rank{r}.pt" for r in range(ctx.world_size)])


MICRO_BATCHES = 4


def counted(model: DDP) -> dict:
    """Count DDP's gradient all-reduces with a comm hook that does what DDP does by default."""
    count = {"all_reduces": 0, "bytes": 0}

    def hook(state, bucket):
        count["all_reduces"] += 1
        count["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return default_hooks.allreduce_hook(None, bucket)
    model.register_comm_hook(None, hook)
    return count


def per_optimizer_step(count: dict, seconds: float) -> dict:
    return {"giveaway": count["all_reduces"], "healthy": count["all_reduces"] == 1,
            "bytes": count["bytes"], "seconds": seconds,  # time: recorded, never asserted
            "text": f"{count['all_reduces']} gradient all-reduce(s), {count['bytes']} bytes "
                    "per optimizer step"}


def accumulation_no_sync_broken(ctx, group, scratch):
    model = DDP(mlp())
    count, start = counted(model), time.perf_counter()
    for i in range(MICRO_BATCHES):
        x, y = batch(ctx.rank, salt=i)
        F.cross_entropy(model(x), y).div(MICRO_BATCHES).backward()  # all-reduces every time
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return per_optimizer_step(count, time.perf_counter() - start)


def accumulation_no_sync_fixed(ctx, group, scratch):
    model = DDP(mlp())
    count, start = counted(model), time.perf_counter()
    for i in range(MICRO_BATCHES):
        x, y = batch(ctx.rank, salt=i)
        last = i == MICRO_BATCHES - 1
        with nullcontext() if last else model.no_sync():  # accumulate locally until the last
            F.cross_entropy(model(x), y).div(MICRO_BATCHES).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return per_optimizer_step(count, time.perf_counter() - start)

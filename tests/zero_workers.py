"""Rank functions for the ZeRO-1 / ZeRO-2 / memory ledger tests (importable, as mp.spawn requires).

One launch per world size runs every check and returns rank 0's findings; every difference is
the largest over all ranks.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as NativeDDP

from ddplab.run.ranks import max_over_ranks
from ddplab.sharded_optimizer import ShardedOptimizer, partition_parameters

STEPS = 4
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}


def several_sizes() -> nn.Module:
    """Layers of several sizes, none a multiple of 3 or 4: 240, 24, 408, 17, 85, 5 elements."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Linear(24, 17), nn.Tanh(),
                         nn.Linear(17, 5))


def batches(rank: int, steps: int = STEPS, size: int = 7, features: int = 10, classes: int = 5):
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(size, features, generator=g),
             torch.randint(0, classes, (size,), generator=g))
            for _ in range(steps)]


def largest_difference(pairs) -> float:
    worst = 0.0
    for a, b in pairs:
        if a.shape != b.shape:
            return float("inf")
        worst = max(worst, (a.double() - b.double()).abs().max().item())
    return worst


def train_with_ddp(make_optimizer, rank: int, steps: int = STEPS):
    """Native DDP for the gradients, ``make_optimizer(params)`` for the update."""
    model = NativeDDP(several_sizes())
    optimizer = make_optimizer(model.parameters())
    for x, y in batches(rank, steps):
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.module, optimizer


def state_pairs(ours: dict, theirs: dict):
    """(ours, theirs) for every tensor of every parameter's state; a missing entry is a mismatch."""
    if ours.keys() != theirs.keys():
        return [(torch.zeros(1), torch.full((1,), float("inf")))]
    return [(ours[k][name], theirs[k][name]) for k in ours for name in ours[k]
            if torch.is_tensor(ours[k][name])]


def zero1_run(name: str, rank: int, world_size: int) -> dict:
    optimizer_class, defaults = OPTIMIZERS[name]
    plain_model, plain = train_with_ddp(lambda p: optimizer_class(p, **defaults), rank)
    native_model, native = train_with_ddp(
        lambda p: ZeroRedundancyOptimizer(p, optimizer_class, **defaults), rank)
    ours_model, ours = train_with_ddp(
        lambda p: ShardedOptimizer(p, optimizer_class, **defaults), rank)

    # This rank's state, parameter by parameter (the parameters are matched by position).
    position = {p: i for i, p in enumerate(ours_model.parameters())}
    by_position = [{p: i for i, p in enumerate(m.parameters())}
                   for m in (plain_model, native_model)]
    ours_state = {position[p]: s for p, s in ours.optim.state.items()}
    plain_state = {by_position[0][p]: plain.state[p] for p in plain_model.parameters()
                   if by_position[0][p] in ours_state}
    native_state = {by_position[1][p]: s for p, s in native.optim.state.items()}

    ours.consolidate_state_dict(to=0)
    native.consolidate_state_dict(to=0)
    found = {
        "params_vs_unsharded": largest_difference(
            zip(ours_model.parameters(), plain_model.parameters(), strict=True)),
        "params_vs_zero_redundancy": largest_difference(
            zip(ours_model.parameters(), native_model.parameters(), strict=True)),
        "state_vs_unsharded": largest_difference(state_pairs(ours_state, plain_state)),
        "state_vs_zero_redundancy": largest_difference(state_pairs(ours_state, native_state)),
        "owned_here": sorted(ours_state),
    }
    found = {k: max_over_ranks(v) if isinstance(v, float) else v for k, v in found.items()}
    if rank == 0:
        full, reference = ours.state_dict(), plain.state_dict()
        found["consolidated_keys_equal"] = full["state"].keys() == reference["state"].keys()
        found["consolidated_vs_unsharded"] = largest_difference(
            state_pairs(full["state"], reference["state"]))
        found["consolidated_groups_equal"] = full["param_groups"] == reference["param_groups"]
        found["consolidated_vs_zero_redundancy"] = largest_difference(
            state_pairs(full["state"], native.state_dict()["state"]))
    found["reload_continues_bitwise"] = reload_and_continue(
        ours_model, ours, plain_model, plain, optimizer_class, defaults, rank)
    found["state_dict_elsewhere"] = state_dict_on_other_rank(ours, rank)
    return found


def reload_and_continue(ours_model, ours, plain_model, plain, optimizer_class, defaults,
                        rank) -> float:
    """Rank 0's consolidated dict loaded on every rank into a fresh ShardedOptimizer: two more
    steps, compared with the unsharded optimizer's two more steps."""
    full = [ours.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(full, src=0)
    model = NativeDDP(copy.deepcopy(ours_model))
    reloaded = ShardedOptimizer(model.parameters(), optimizer_class, **defaults)
    reloaded.load_state_dict(full[0])
    plain_ddp = NativeDDP(plain_model)
    for x, y in batches(rank + 50, 2):
        for m, opt in ((model, reloaded), (plain_ddp, plain)):
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
            opt.zero_grad()
    return max_over_ranks(largest_difference(
        zip(model.module.parameters(), plain_model.parameters(), strict=True)))


def state_dict_on_other_rank(ours, rank) -> str | None:
    """What ``state_dict()`` says on rank 1, where nothing was consolidated (sent to rank 0)."""
    message = [None]
    if rank == 1:
        try:
            ours.state_dict()
            message[0] = "no error"
        except RuntimeError as error:
            message[0] = str(error)
    dist.broadcast_object_list(message, src=1)
    return message[0]


def owner_maps(world_size: int) -> dict:
    """Ours and ZeroRedundancyOptimizer's owner of every parameter (by position), for one group
    and for two groups (weights with decay, biases without: the totals carry over)."""
    model = several_sizes()
    params = list(model.parameters())
    weights, biases = params[0::2], params[1::2]
    two_groups = [{"params": weights, "weight_decay": 0.1},
                  {"params": biases, "weight_decay": 0.0}]
    position = {p: i for i, p in enumerate(params)}
    found = {}
    for case, given in (("one_group", params), ("two_groups", two_groups)):
        native = ZeroRedundancyOptimizer(given, torch.optim.AdamW, lr=1e-3)
        ours = ShardedOptimizer(given, torch.optim.AdamW, lr=1e-3)
        found[case] = {
            "function": [[position[p] for p in owned]
                         for owned in partition_parameters(given, world_size)],
            "native": [[position[p] for g in groups for p in g["params"]]
                       for groups in native._partition_parameters()],
            "ours_owner": {position[p]: r for p, r in ours.owner.items()},
            "native_owner": {position[p]: r for p, r in native._param_to_rank.items()},
        }
    return found


def with_scheduler(rank: int) -> float:
    """A learning-rate scheduler changes ``param_groups``; the owners' optimizers must follow."""
    def train(make_optimizer):
        model = NativeDDP(several_sizes())
        optimizer = make_optimizer(model.parameters())
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
        for x, y in batches(rank):
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
        return model.module

    plain = train(lambda p: torch.optim.AdamW(p, lr=0.05))
    ours = train(lambda p: ShardedOptimizer(p, torch.optim.AdamW, lr=0.05))
    return max_over_ranks(largest_difference(
        zip(ours.parameters(), plain.parameters(), strict=True)))


def zero1_checks(ctx, args) -> dict | None:
    results = {"owner_maps": owner_maps(ctx.world_size), "scheduler": with_scheduler(ctx.rank)}
    for name in OPTIMIZERS:
        results[name] = zero1_run(name, ctx.rank, ctx.world_size)
    return results if ctx.is_main else None


# ---------------------------------------------------------------- ZeRO-2 (ddplab/zero2.py)

def aligned_sizes() -> nn.Module:
    """Every parameter's length a multiple of 12: no bucket of one parameter needs padding at
    2, 3 or 4 ranks (288, 24, 864, 36, 432, 12 elements)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 36), nn.Tanh(),
                         nn.Linear(36, 12))


ZERO2_CASES = {  # name: (model, bucket_cap_mb) — a tiny cap gives one bucket per parameter
    "aligned_one_bucket_per_param": (aligned_sizes, 1e-6),
    "padded_one_bucket": (several_sizes, 25.0),
    "padded_one_bucket_per_param": (several_sizes, 1e-6),
}


def native_after_rebuild(make_model, cap: float, rank: int, warm_up: bool = True):
    """Native DDP after one backward without a step: its buckets are rebuilt in gradient-ready
    order, the layout ``ShardedGradients`` uses (the first iteration's is one bucket in
    definition order).  ``warm_up=False``: the first step runs in that first layout."""
    model = NativeDDP(make_model(), bucket_cap_mb=cap)
    if not warm_up:
        return model
    x, y = batches(rank + 77, 1, features=model.module[0].in_features)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return model


def zero2_run(make_model, cap: float, optimizer_name: str, rank: int,
              warm_up: bool = True) -> dict:
    from ddplab.zero2 import ShardedGradients

    optimizer_class, defaults = OPTIMIZERS[optimizer_name]
    native = native_after_rebuild(make_model, cap, rank, warm_up)
    reference = optimizer_class(native.parameters(), **defaults)
    ours = ShardedGradients(make_model(), bucket_cap_mb=cap)
    optimizer = optimizer_class(ours.shard_parameters(), **defaults)
    for x, y in batches(rank, features=native.module[0].in_features):
        for model, opt, gather in ((native, reference, None),
                                   (ours, optimizer, ours.gather_parameters)):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if gather is not None:
                gather()
            opt.zero_grad()
    return {
        "params": max_over_ranks(largest_difference(
            zip(ours.module.parameters(), native.module.parameters(), strict=True))),
        "state": max_over_ranks(gathered_state_difference(ours, optimizer, reference, native)),
        "layout": [b.names for b in ours.buckets],
    }


def gathered_state_difference(ours, optimizer, reference, native) -> float:
    """Every shard's state all-gathered into its bucket's layout, compared parameter by
    parameter with the unsharded optimizer's state (parameters matched by position)."""
    twin = dict(zip(ours.module.parameters(), native.module.parameters(), strict=True))
    worst = 0.0
    for bucket in ours.buckets:
        for name, shard_state in optimizer.state[bucket.shard].items():
            if shard_state.dim() == 0:
                theirs = [reference.state[twin[p]][name] for p in bucket.params]
                worst = max(worst, *((shard_state - t).abs().item() for t in theirs))
                continue
            full = torch.empty_like(bucket.flat)
            dist.all_gather_into_tensor(full, shard_state)
            offset = 0
            for p in bucket.params:
                mine = full[offset:offset + p.numel()].view_as(p)
                worst = max(worst, largest_difference([(mine, reference.state[twin[p]][name])]))
                offset += p.numel()
    return worst


def zero2_bytes(rank: int) -> dict:
    """Wrap the two collectives for one step and record the buffer each one covers."""
    from ddplab import zero2

    model = zero2.ShardedGradients(several_sizes(), bucket_cap_mb=1e-3)
    optimizer = torch.optim.SGD(model.shard_parameters(), lr=0.1)
    recorded = []
    originals = dist.reduce_scatter_single, dist.all_gather_single

    def reduce_scatter(output, input, *args, **kwargs):
        recorded.append(("reduce_scatter", input.numel() * input.element_size()))
        return originals[0](output, input, *args, **kwargs)

    def all_gather(output, input, *args, **kwargs):
        recorded.append(("all_gather", output.numel() * output.element_size()))
        return originals[1](output, input, *args, **kwargs)

    dist.reduce_scatter_single, dist.all_gather_single = reduce_scatter, all_gather
    try:
        x, y = batches(rank, 1)[0]
        nn.functional.cross_entropy(model(x), y).backward()
        full_grads_kept = sum(p.grad is not None for p in model.module.parameters())
        optimizer.step()
        model.gather_parameters()
    finally:
        dist.reduce_scatter_single, dist.all_gather_single = originals
    world = model.world_size
    fresh = zero2.ShardedGradients(several_sizes(), bucket_cap_mb=1e-3)
    nn.functional.cross_entropy(fresh(x), y).backward()
    once = [b.shard.grad.clone() for b in fresh.buckets]
    nn.functional.cross_entropy(fresh(x), y).backward()  # the same batch again: adds
    accumulated = largest_difference(
        (b.shard.grad, 2 * g) for b, g in zip(fresh.buckets, once, strict=True))
    return {
        "recorded": recorded,
        "predicted": zero2.collective_payloads(model),
        "measured_sent": sum(zero2.ring_bytes_sent(op, b, world) for op, b in recorded),
        "predicted_sent": zero2.bytes_sent_per_step(model),
        "measured_sent_gloo": sum(zero2.ring_bytes_sent(op, b, world, gloo=True)
                                  for op, b in recorded),
        "predicted_sent_gloo": zero2.bytes_sent_per_step(model, gloo=True),
        "numel": sum(p.numel() for p in model.module.parameters()),
        "padded_numel": sum(b.flat.numel() for b in model.buckets),
        "full_grads_kept": full_grads_kept,
        "second_backward_vs_twice_the_first": accumulated,
        "shard_grad_numels": [b.shard.grad is None or b.shard.grad.numel()
                              for b in model.buckets],
    }


def zero2_checks(ctx, args) -> dict | None:
    results = {f"{case}/{opt}": zero2_run(*ZERO2_CASES[case], opt, ctx.rank)
               for case in ZERO2_CASES for opt in OPTIMIZERS}
    results["bytes"] = zero2_bytes(ctx.rank)
    results["padding_control"] = padding_control(ctx.rank, ctx.world_size)
    results["control_native_first_layout"] = zero2_run(several_sizes, 25.0, "sgd_momentum",
                                                       ctx.rank, warm_up=False)
    return results if ctx.is_main else None


# ---------------------------------------------------------------- the memory ledger

def probe_mlp() -> nn.Module:
    """The ledger's probe: 1732 parameters (6928 B), its largest tensor 1024 elements."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def one_step(model: nn.Module, optimizer, rank: int, after=None) -> None:
    """One AdamW step; the gradients are left in place, so the ledger sees them."""
    x, y = batches(rank, 1, features=16, classes=4)[0]
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    if after is not None:
        after()


def as_dict(ledger) -> dict:
    return {"params": ledger.params, "grads": ledger.grads,
            "optimizer_state": ledger.optimizer_state, "counters": ledger.counters}


def ledger_checks(ctx, args) -> dict | None:
    from ddplab import memory_ledger as ml
    from ddplab.zero2 import ShardedGradients

    rank, world = ctx.rank, ctx.world_size
    found = {}
    adamw = {"lr": 1e-2, "weight_decay": 0.1}

    ddp = NativeDDP(probe_mlp())
    opt = torch.optim.AdamW(ddp.parameters(), **adamw)
    one_step(ddp, opt, rank)
    params = list(ddp.parameters())
    found["ddp"] = (ml.measure(params, opt), ml.ddp_ledger(params))

    for name, make in (("zero1_ours", ShardedOptimizer), ("zero1_native", ZeroRedundancyOptimizer)):
        model = NativeDDP(probe_mlp())
        opt = make(model.parameters(), torch.optim.AdamW, **adamw)
        one_step(model, opt, rank)
        params = list(model.parameters())
        found[name] = (ml.measure(params, opt.optim), ml.zero1_ledger(params, world, rank))

    zero2 = ShardedGradients(probe_mlp())
    opt = torch.optim.AdamW(zero2.shard_parameters(), **adamw)
    one_step(zero2, opt, rank, after=zero2.gather_parameters)
    numels = [sum(p.numel() for p in b.params) for b in zero2.buckets]
    found["zero2"] = (ml.measure([*zero2.module.parameters(), *zero2.shard_parameters()], opt),
                      ml.zero2_ledger(numels, world))

    found["zero3_fully_shard"] = fully_shard_ledger(rank, world, adamw)
    results = {case: {"measured": as_dict(m), "predicted": as_dict(p)}
               for case, (m, p) in found.items()}
    every_rank = [None] * world
    dist.all_gather_object(every_rank, results)
    return every_rank if ctx.is_main else None


def fully_shard_ledger(rank: int, world: int, adamw: dict):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ddplab import memory_ledger as ml

    model = probe_mlp()
    shapes = [tuple(p.shape) for p in model.parameters()]
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **adamw)
    one_step(model, opt, rank)
    return ml.measure(model.parameters(), opt), ml.zero3_ledger(shapes, world, rank)


def padding_control(rank: int, world: int) -> dict:
    """All-reduce of n elements against reduce-scatter + all-gather of the same n padded (a) to
    the next multiple of N, as ShardedGradients pads, and (b) by N more elements: the elements
    whose bits differ from the all-reduce's, over several n."""
    g = torch.Generator().manual_seed(500 + rank)
    differ = {"minimal": [], "one_more_shard": []}
    for n in range(990, 1010):
        x = torch.randn(n, generator=g) * (1.0 / world)
        reference = x.clone()
        dist.all_reduce(reference)
        for name, pad in (("minimal", (-n) % world), ("one_more_shard", (-n) % world + world)):
            padded = torch.cat([x, torch.zeros(pad)])
            shard = torch.empty(padded.numel() // world)
            dist.reduce_scatter_tensor(shard, padded)
            dist.all_gather_into_tensor(padded, shard)
            differ[name] += [(n, i) for i in (padded[:n] != reference).nonzero().flatten().tolist()]
    return differ

"""Rank functions for the FullyShardedDP tests (importable, as mp.spawn requires).

Each runs many checks in one launch and returns rank 0's findings; a difference is the largest
|ours - native| over every rank (MAX all-reduce), so 0.0 means bitwise on every rank.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ddplab import FullyShardedDP
from ddplab.fsdp import clip_grad_norm_
from ddplab.fsdp_layout import offsets, parameter_major, shard, split_shards
from ddplab.run.ranks import max_over_ranks


def model() -> nn.Module:
    """Dim-0 sizes 10, 5, 4 (and 10 for the LayerNorm): none divides by 3, and 4 rows over 3
    ranks leave rank 2 an empty shard of the last weight."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 10), nn.ReLU(), nn.LayerNorm(10), nn.Linear(10, 5),
                         nn.ReLU(), nn.Linear(5, 4))


class WithRootParameter(nn.Module):
    """Two layers and a parameter of the root's own: the root is a unit too."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(7, 10), nn.Linear(10, 4)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return self.second(torch.relu(self.first(x))) * self.scale


def batches(rank: int, steps: int, size: int = 6, seed: int = 100):
    g = torch.Generator().manual_seed(seed + rank)
    return [(torch.randn(size, 7, generator=g), torch.randint(0, 4, (size,), generator=g))
            for _ in range(steps)]


def native(module: nn.Module) -> nn.Module:
    """``fully_shard`` on each child with parameters, then on the root."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for child in module.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    return fully_shard(module, mesh=mesh)


def set_sync(wrapped, flag: bool) -> None:
    wrapped.set_requires_gradient_sync(flag)


def train(wrapped, data, accumulate: int = 1, sync_each: bool = True, opt=None):
    """AdamW; ``accumulate`` micro-batches per step, either reduced every micro-batch
    (``sync_each``) or accumulated unsharded and reduced once (gradient sync off but last)."""
    opt = opt or torch.optim.AdamW(wrapped.parameters(), lr=0.05, weight_decay=0.1)
    for x, y in data:
        for i, (xm, ym) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate), strict=True)):
            set_sync(wrapped, sync_each or i == accumulate - 1)
            loss = nn.functional.cross_entropy(wrapped(xm), ym) / accumulate
            loss.backward()
        finish(wrapped)
        opt.step()
        opt.zero_grad()
    return opt


def finish(wrapped) -> None:
    if isinstance(wrapped, FullyShardedDP):
        wrapped.finish_gradient_synchronization()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def diff(xs, ys) -> float:
    pairs = list(zip(xs, ys, strict=True))
    assert all(local(a).shape == local(b).shape for a, b in pairs)
    worst = max(((local(a).double() - local(b).double()).abs().max().item()
                 for a, b in pairs if local(a).numel()), default=0.0)
    return max_over_ranks(worst)


def state_diff(ours, ours_opt, theirs, native_opt) -> float:
    """Parameters (this rank's shards) and AdamW state, ours against native's DTensors."""
    pairs = list(zip(ours.parameters(), theirs.parameters(), strict=True))
    tensors = [(p, q) for p, q in pairs]
    for p, q in pairs:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            tensors.append((ours_opt.state[p][key], native_opt.state[q][key]))
    return diff([a for a, _ in tensors], [b for _, b in tensors])


class FlatLayoutFSDP(FullyShardedDP):
    """The mistake: a DDP bucket's flat parameter-major message, all-reduced (AVG), each rank
    keeping its rows.  The same sums, at other offsets of the message."""

    def reduce_scatter(self, grads, shapes, group):
        message = parameter_major(grads, self.world)
        dist.all_reduce(message, op=dist.ReduceOp.AVG, group=group)
        per_tensor = message.split([m.numel() for m in _padded(grads, self.world)])
        return [shard(t.view(-1, *s[1:])[:s[0]], self.rank, self.world)
                for t, s in zip(per_tensor, shapes, strict=True)]


def _padded(grads, world):
    return [g.new_empty((-(-g.shape[0] // world) * world, *g.shape[1:])) for g in grads]


def pair(steps: int = 4, make=model, **ours_kwargs):
    """Ours and native from the same model, trained on the same data."""
    rank = dist.get_rank()
    data = batches(rank, steps)
    ours, theirs = FullyShardedDP(make(), **ours_kwargs), native(make())
    ours_opt, theirs_opt = train(ours, data), train(theirs, data)
    return state_diff(ours, ours_opt, theirs, theirs_opt)


def bitwise_cases(ctx, args) -> dict:
    out = {"default": pair(),
           "keep_after_forward": pair(reshard_after_forward=False),
           "root_parameter": pair(make=WithRootParameter)}
    data = batches(dist.get_rank(), 4)
    flat, theirs = FlatLayoutFSDP(model()), native(model())
    flat_opt, theirs_opt = train(flat, data), train(theirs, data)
    out["flat_layout"] = state_diff(flat, flat_opt, theirs, theirs_opt)
    out.update(accumulation_cases())
    out.update(full_state_cases())
    out.update(hook_cases())
    return out


def _watch_later_units(ours, output: torch.Tensor, seen: list) -> None:
    if output.requires_grad:
        output.register_hook(lambda grad: seen.append([u.gathered for u in ours.units[1:]]))


def hook_cases() -> dict:
    """What a unit holds between forward and backward, and what finishing a second time does."""
    out = {}
    x, y = batches(dist.get_rank(), 1)[0]
    for keep in (False, True):
        ours = FullyShardedDP(model(), reshard_after_forward=not keep)
        later_gathered = []  # when the first unit's backward starts, the later ones are done
        ours.units[0].module.register_forward_hook(
            lambda m, a, out, o=ours, seen=later_gathered: _watch_later_units(o, out, seen))
        loss = nn.functional.cross_entropy(ours(x), y)
        out[f"full_bytes_after_forward_keep_{keep}"] = sum(
            f.untyped_storage().nbytes() for u in ours.units for f in u.full)
        out[f"parameters_between_keep_{keep}"] = [tuple(p.shape) for p in ours.parameters()]
        loss.backward()
        out[f"later_units_gathered_in_backward_keep_{keep}"] = later_gathered
        out[f"full_bytes_after_backward_keep_{keep}"] = sum(
            f.untyped_storage().nbytes() for u in ours.units for f in u.full)
    grads = [p.grad.clone() for p in ours.parameters()]
    with torch.no_grad():  # an evaluation: nothing will come to free what it gathered
        ours(x)
    out["full_bytes_after_no_grad_forward_keep_True"] = sum(
        f.untyped_storage().nbytes() for u in ours.units for f in u.full)
    sent = dict(ours.bytes)
    ours.finish_gradient_synchronization()
    out["finish_again_sends"] = {k: ours.bytes[k] - sent[k] for k in sent}
    out["finish_again_grads"] = diff([p.grad for p in ours.parameters()], grads)
    out["every_shard_has_grad"] = all(p.grad is not None for p in ours.parameters())
    out["full_numel"] = sum(p.numel() for p in model().parameters())
    out.update(held_gradients(x, y))
    return out


def held_gradients(x, y) -> dict:
    """Gradient bytes a rank holds after a backward without sync, then after one with it."""
    ours = FullyShardedDP(model())

    def held() -> dict:
        return {"full": sum(f.grad.nbytes for u in ours.units for f in u.full
                            if f.grad is not None),
                "shards": sum(p.grad.nbytes for p in ours.parameters() if p.grad is not None)}

    with ours.no_sync():
        nn.functional.cross_entropy(ours(x), y).backward()
    unsynced = held()
    nn.functional.cross_entropy(ours(x), y).backward()
    return {"held_without_sync": unsynced, "held_after_sync": held(),
            "shard_numel": sum(p.numel() for p in ours.parameters()),
            "sync_restored": ours.requires_gradient_sync}


def full_state_cases() -> dict:
    ours, theirs = FullyShardedDP(model()), native(model())
    data = batches(dist.get_rank(), 2)
    train(ours, data), train(theirs, data)
    mine = ours.full_state_dict()
    native_full = {n: p.full_tensor() for n, p in theirs.named_parameters()}
    return {"full_state_names": sorted(mine) == sorted(native_full),
            "full_state": diff([mine[n] for n in sorted(native_full)],
                               [native_full[n] for n in sorted(native_full)]),
            "parameters_are_shards": [tuple(p.shape) for p in ours.parameters()],
            "native_local_shapes": [tuple(local(p).shape) for p in theirs.parameters()]}


def accumulation_cases(accumulate: int = 3) -> dict:
    """Reduce every micro-batch vs accumulate unsharded and reduce once, each against native."""
    data = [(x, y) for x, y in batches(dist.get_rank(), 2, size=6)]
    out = {}
    for mode, sync_each in (("every_micro_batch", True), ("once_per_step", False)):
        ours, theirs = FullyShardedDP(model()), native(model())
        ours_opt = train(ours, data, accumulate, sync_each)
        theirs_opt = train(theirs, data, accumulate, sync_each)
        out[f"accumulate_{mode}"] = state_diff(ours, ours_opt, theirs, theirs_opt)
        out[f"bytes_{mode}"] = dict(ours.bytes)
        out[f"params_{mode}"] = [p.detach().clone() for p in ours.parameters()]
    out["modes_differ_by"] = diff(out.pop("params_every_micro_batch"),
                                  out.pop("params_once_per_step"))
    return out


def three_rank_cases(ctx, args) -> dict:
    return {"element": first_differing_element(ctx, args), "clip": clip_cases(ctx, args)}


def clip_cases(ctx, args) -> dict:
    """Our global-norm clip against torch's clip_grad_norm_ on the full model's gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, max_norm in (("clipped", 0.05), ("not_clipped", 1e6)):
        ours = FullyShardedDP(model())
        x, y = batches(rank, 1)[0]
        nn.functional.cross_entropy(ours(x), y).backward()
        shards = list(ours.parameters())
        full_grads = gather_full_grads(ours)
        reference = copy.deepcopy(full_grads)
        ref_norm = torch.nn.utils.clip_grad_norm_(_as_params(reference), max_norm)
        wrong = [p.grad.clone() for p in shards]
        ours_norm = clip_grad_norm_(shards, max_norm)
        local_norm = torch.nn.utils.clip_grad_norm_(_as_params(wrong), max_norm)
        expected = [shard(g, rank, world) for g in reference]
        out[name] = {
            "norm_rel": abs(ours_norm.item() - ref_norm.item()) / ref_norm.item(),
            "norm_equal": max_over_ranks(float(ours_norm.item() != ref_norm.item())) == 0,
            "grads_rel": diff([p.grad for p in shards], expected) / max_abs(expected),
            "local_norm_rel": max_over_ranks(abs(local_norm.item() - ref_norm.item())
                                             / ref_norm.item()),
            "local_grads_rel": diff(wrong, expected) / max_abs(expected),
            "numel": sum(g.numel() for g in reference),
        }
    return out


def max_abs(tensors) -> float:
    return max_over_ranks(max((t.abs().max().item() for t in tensors if t.numel()),
                              default=0.0))


def gather_full_grads(ours: FullyShardedDP) -> list[torch.Tensor]:
    """Every shard's averaged gradient gathered back into full tensors (exact: copies only)."""
    world = dist.get_world_size()
    full = []
    for p, name in zip(ours.parameters(), _names(ours), strict=True):
        rows = ours.module.get_parameter(name)  # the shard; the full shape comes from the unit
        shape = _full_shape(ours, name)
        padded = -(-shape[0] // world)
        mine = p.grad.new_zeros((padded, *shape[1:]))
        mine[:rows.shape[0]] = p.grad
        gathered = mine.new_empty((padded * world, *shape[1:]))
        dist.all_gather_single(gathered, mine)
        full.append(gathered[:shape[0]].clone())
    return full


def _names(ours):
    return [n for n, _ in ours.module.named_parameters()]


def _full_shape(ours, name):
    for unit in ours.units:
        prefix = "" if unit.module is ours.module else next(
            n for n, m in ours.module.named_modules() if m is unit.module) + "."
        for n, s in zip(unit.names, unit.shapes, strict=True):
            if prefix + n == name:
                return s
    raise KeyError(name)


def _as_params(grads):
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    return params


def first_differing_element(ctx, args) -> dict:
    """One backward, its first unit reduced both ways: the first element (in parameter order,
    then element order) whose averaged value differs, with every rank's term and each order of
    adding the N terms, so the test can name which order each layout used."""
    rank, world = dist.get_rank(), dist.get_world_size()
    net = model()
    x, y = batches(rank, 1)[0]
    nn.functional.cross_entropy(net(x), y).backward()
    unit = net[0]
    names = [n for n, _ in unit.named_parameters()]
    grads = [p.grad for _, p in unit.named_parameters()]
    shapes = [g.shape for g in grads]
    message = torch._chunk_cat(grads, dim=0, num_chunks=world)
    row = message.new_empty(message.shape[1])
    dist.reduce_scatter_single(row, message.view(-1), op=dist.ReduceOp.AVG)
    natives = split_shards(row, shapes, rank, world)
    flats = FlatLayoutFSDP.reduce_scatter(_Bare(rank, world), grads, shapes, None)
    found = None
    for index, (a, b) in enumerate(zip(natives, flats, strict=True)):
        rows_before = -(-shapes[index][0] // world) * rank
        inner = a[0].numel() if a.numel() else 0
        bad = (a.reshape(-1) != b.reshape(-1)).nonzero()
        if bad.numel():
            local_index = bad[0].item()
            found = (index, rows_before * inner + local_index, a.reshape(-1)[local_index].item(),
                     b.reshape(-1)[local_index].item())
            break
    every = [None] * world
    dist.all_gather_object(every, found)
    index, element, native_value, flat_value = min(e for e in every if e is not None)
    terms = [None] * world
    dist.all_gather_object(terms, grads[index].reshape(-1)[element].item())
    return {"name": f"0.{names[index]}", "element": element,
            "position": list(divmod(element, shapes[index][1:].numel())),
            "native": native_value, "flat": flat_value, "terms": terms,
            "offsets": offsets(shapes, index, element, world),
            "message_numel": message.numel(),
            "orders": sum_orders(terms)}


class _Bare:
    """Just what FlatLayoutFSDP.reduce_scatter reads, without wrapping a model."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world


def sum_orders(terms: list[float]) -> dict:
    """Every way a ring can add the N terms of an element (float32), divided by N."""
    world = len(terms)
    t = [torch.tensor(v, dtype=torch.float32) for v in terms]
    out = {}
    for start in range(world):  # a ring starts at one rank and adds the next ones in turn
        order = [(start + k) % world for k in range(world)]
        total, label = t[order[0]], f"g{order[0]}"
        for r in order[1:]:
            total, label = total + t[r], f"({label}+g{r})"
        out[label[1:-1]] = (total / world).item()
    return out


# --- a sharded run saved at 2 ranks, resumed at 3 -------------------------------------------

SAVED_STEPS, RESUMED_STEPS = 3, 3


def adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def dcp_save(ctx, args) -> dict:
    """``fully_shard`` trained SAVED_STEPS at 2 ranks, saved twice: DCP's sharded checkpoint
    (every rank writes its DTensor shards) and the full state (gathered, saved by rank 0)."""
    net = native(model())
    opt = train(net, batches(dist.get_rank(), SAVED_STEPS), opt=adamw(net.parameters()))
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=Path(args.out) / "dcp")
    full = get_state_dict(net, opt, options=StateDictOptions(full_state_dict=True,
                                                             cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(full, Path(args.out) / "full.pt")
    return {"sharded_types": sorted({type(v).__name__ for v in model_sd.values()})}


def dcp_resume(ctx, args) -> dict:
    """At 3 ranks: the DCP checkpoint resharded into ``fully_shard`` and into FullyShardedDP,
    against the same run's full state loaded into ``fully_shard``; then each trains on."""
    folder = Path(args.out)
    reference, mutated = native_from_full(folder, with_optimizer=True)
    runs = {"": native_from_dcp(folder), "ours_": ours_from_dcp(folder)}
    control, _ = native_from_full(folder, with_optimizer=False)  # no AdamW state: must differ
    out = {f"{name}loaded": state_diff(*run, *reference) for name, run in runs.items()}
    data = batches(dist.get_rank(), RESUMED_STEPS, seed=200)
    for net, opt in (reference, control, *runs.values()):
        train(net, data, opt=opt)
    out.update({f"{name}continued": state_diff(*run, *reference) for name, run in runs.items()})
    out["without_optimizer_state"] = diff(list(control[0].parameters()),
                                          list(reference[0].parameters()))
    out["full_after_set"] = mutated
    return out


def native_from_full(folder: Path, with_optimizer: bool):
    """``fully_shard`` at this world size, loaded from the gathered full state."""
    model_full, optim_full = torch.load(folder / "full.pt", weights_only=True)
    net = native(model())
    opt = adamw(net.parameters())
    options = StateDictOptions(full_state_dict=True)
    if with_optimizer:
        set_state_dict(net, opt, model_state_dict=model_full, optim_state_dict=optim_full,
                       options=options)
    else:
        set_model_state_dict(net, model_full, options=options)
    # torch 2.13's loader puts the DTensors it made back into the dict it was given.
    return (net, opt), sorted({type(v).__name__ for v in model_full.values()})


def native_from_dcp(folder: Path):
    """``fully_shard`` at this world size, loaded from the 2-rank DCP checkpoint (resharded)."""
    net = native(model())
    opt = adamw(net.parameters())
    model_sd, optim_sd = get_state_dict(net, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder / "dcp")
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return net, opt


def ours_from_dcp(folder: Path):
    ours = FullyShardedDP(model())
    opt = adamw(ours.parameters())
    model_full, optim_full = torch.load(folder / "full.pt", weights_only=True)  # shapes only
    load_into_ours(ours, opt, folder / "dcp", model_full, optim_full)
    return ours, opt


def load_into_ours(ours, opt, checkpoint, model_full, optim_full) -> None:
    """The DCP checkpoint read into plain full tensors (DCP reads whatever pieces cover them),
    then each rank keeps its shard of every parameter and of its AdamW state."""
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {"model": {k: torch.empty_like(v) for k, v in model_full.items()},
             "optim": {"state": {k: {s: torch.empty_like(t) for s, t in v.items()}
                                 for k, v in optim_full["state"].items()},
                       "param_groups": optim_full["param_groups"]}}
    dcp.load(state, checkpoint_id=checkpoint)
    names = [n for n, _ in ours.module.named_parameters()]
    with torch.no_grad():
        for name, p in zip(names, ours.parameters(), strict=True):
            p.copy_(shard(state["model"][name], rank, world))
            saved = state["optim"]["state"][name]
            opt.state[p] = {"step": saved["step"].clone(),
                            "exp_avg": shard(saved["exp_avg"], rank, world),
                            "exp_avg_sq": shard(saved["exp_avg_sq"], rank, world)}

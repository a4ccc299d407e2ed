"""Bugs of sharded models (chapter 11): a forward only some ranks run, a gradient norm clipped on
one shard, a state dict saved from one rank.

Same convention as ``ddp_errors.py``: ``<name>_broken`` / ``<name>_fixed``, called on every rank
as ``fn(ctx, group, scratch)``; ``group`` has a timeout of a few seconds.  The models are
sharded by torch's ``fully_shard`` (FSDP2) on a CPU mesh built from ``group``, except for the
clipping bug, which needs parameters that are plain local shards — as FSDP1's flat parameters
and the book's ``FullyShardedDP`` are — for ``torch.nn.utils.clip_grad_norm_`` to go wrong.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from ..fsdp import FullyShardedDP, clip_grad_norm_
from .ddp_errors import batch, mlp, train


def sharded(model: nn.Module, group) -> nn.Module:
    """``fully_shard`` on every layer with parameters, then on the root, over ``group``.

    The mesh is named after the group: ``DeviceMesh.__eq__`` compares ranks, layout and names,
    not the process group (device_mesh.py), and with unnamed meshes a later scenario's full
    state dict was gathered over an earlier scenario's timed-out group ("Application timeout
    caused pair closure").
    """
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=(f"group_{group.group_name}",))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def skipped_gather_broken(ctx, group, scratch):
    model = sharded(mlp(), group)
    x, y = batch(ctx.rank, salt=7)  # a validation batch
    if ctx.rank == 0:  # "only rank 0 logs": but every forward of a sharded model all-gathers
        with torch.no_grad():
            print(f"validation loss {F.cross_entropy(model(x), y).item():.3f}")
    dist.barrier(group=group)  # rank 1 waits here, rank 0 in the first layer's all-gather


def skipped_gather_fixed(ctx, group, scratch):
    model = sharded(mlp(), group)
    x, y = batch(ctx.rank, salt=7)  # a validation batch
    with torch.no_grad():  # every rank runs the forward: each one's shards are needed
        loss = F.cross_entropy(model(x), y).item()
    if ctx.rank == 0:  # only the printing is rank 0's
        print(f"validation loss {loss:.3f}")
    dist.barrier(group=group)


MAX_NORM = 0.1  # small enough that every step clips
CLIP_STEPS = 3


def clipped_training(ctx, group, clip) -> dict:
    """The same steps on a sharded model (``clip`` on its shards) and on an unsharded DDP model
    (``clip_grad_norm_`` on the full gradients): the check a careful engineer adds."""
    torch.manual_seed(0)
    ours = FullyShardedDP(mlp(), group=group)
    torch.manual_seed(0)
    reference = DDP(mlp(), process_group=group)
    norms = []
    for model, clip_fn in ((ours, clip), (reference, torch.nn.utils.clip_grad_norm_)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(CLIP_STEPS):
            x, y = batch(ctx.rank, salt=step)
            F.cross_entropy(model(x), y).backward()
            norms.append(float(clip_fn(list(model.parameters()), MAX_NORM)))
            opt.step()
            opt.zero_grad()
    full = ours.full_state_dict()
    drift = max((full[k] - v).abs().max().item()
                for k, v in reference.module.state_dict().items())
    used, true = norms[:CLIP_STEPS], norms[CLIP_STEPS:]
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, used[0], group=group)
    return {"giveaway": drift, "healthy": drift < 1e-5,
            "norm_used_per_rank": every, "model_norm": true[0],
            "text": f"the parameters are {drift:.3g} from unsharded training after "
                    f"{CLIP_STEPS} steps (step 1 clipped by the norms "
                    f"{', '.join(f'{n:.4g}' for n in every)} per rank; the model's gradient "
                    f"norm is {true[0]:.4g})"}


def local_norm_clip_broken(ctx, group, scratch):
    # parameters() are this rank's shards: the norm of a shard, different on every rank
    return clipped_training(ctx, group, torch.nn.utils.clip_grad_norm_)


def local_norm_clip_fixed(ctx, group, scratch):
    # the squared norms of the shards, summed over the ranks: the whole model's norm
    return clipped_training(ctx, group, lambda shards, max_norm: clip_grad_norm_(
        shards, max_norm, group=group))


def save_one_rank_broken(ctx, group, scratch):
    model = sharded(mlp(), group)
    train(model, ctx)
    if ctx.rank == 0:  # the usual "rank 0 saves": but rank 0 holds only its shards
        state = {name: t.to_local() for name, t in model.state_dict().items()}
        torch.save(state, scratch / "model.pt")
    dist.barrier(group=group)
    fresh = mlp()  # later: load it for inference, in one process
    fresh.load_state_dict(torch.load(scratch / "model.pt"))


def save_one_rank_fixed(ctx, group, scratch):
    model = sharded(mlp(), group)
    train(model, ctx)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)  # every rank: it all-gathers
    if ctx.rank == 0:  # with cpu_offload, only rank 0 gets the full tensors
        torch.save(state, scratch / "model.pt")
    dist.barrier(group=group)
    fresh = mlp()  # later: load it for inference, in one process
    fresh.load_state_dict(torch.load(scratch / "model.pt"))

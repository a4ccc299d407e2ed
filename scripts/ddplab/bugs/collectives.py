"""Bugs in how ranks meet: a collective only some ranks call, shapes that differ, ranks that run
out of data at different times, a rank that dies, a port already taken, a call made too early.

Same convention as ``ddp_errors.py``: ``<name>_broken`` / ``<name>_fixed``, called on every rank
as ``fn(ctx, group, scratch)``, except the last two, which run in the launching process before
any process group exists.  ``group`` has a timeout of a few seconds: that is how a hang ends here.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from .ddp_errors import batch, mlp


def step(model, opt, x, y) -> None:
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


# --8<-- [start:evaluate]
def evaluate(model, x, y, group) -> float:
    """Validation loss averaged over ranks: a collective, so *every* rank must call it."""
    with torch.no_grad():
        loss = F.cross_entropy(model(x), y)
    dist.all_reduce(loss, group=group)
    return loss.item() / dist.get_world_size(group)
# --8<-- [end:evaluate]


def one_rank_collective_broken(ctx, group, scratch):
    model, (x, y) = mlp(), batch(ctx.rank)
    if ctx.rank == 0:  # "only rank 0 logs"
        print(f"validation loss {evaluate(model, x, y, group):.3f}")
    dist.barrier(group=group)  # rank 1 waits here, rank 0 in evaluate's all_reduce


def one_rank_collective_fixed(ctx, group, scratch):
    model, (x, y) = mlp(), batch(ctx.rank)
    loss = evaluate(model, x, y, group)  # every rank takes part
    if ctx.rank == 0:  # only the printing is rank 0's
        print(f"validation loss {loss:.3f}")
    dist.barrier(group=group)


def losses_left(ctx) -> torch.Tensor:
    """The per-sample losses of this rank's last, partial batch: 3 on rank 0, 4 on rank 1."""
    return torch.arange(3.0 + ctx.rank)


def mismatched_shapes_broken(ctx, group, scratch):
    losses = losses_left(ctx)  # rank 0: 3 values, rank 1: 4
    dist.all_reduce(losses, group=group)  # the sizes differ across ranks
    return {"rank 0 got": losses.tolist()} if ctx.rank == 0 else None


def mismatched_shapes_fixed(ctx, group, scratch):
    losses = losses_left(ctx)
    total = torch.stack([losses.sum(), torch.tensor(float(len(losses)))])  # same shape everywhere
    dist.all_reduce(total, group=group)
    return {"mean loss": (total[0] / total[1]).item()} if ctx.rank == 0 else None


def my_batches(ctx) -> list:
    """An uneven split: rank 0 has 3 batches, rank 1 has 2 (and so on, one fewer per rank)."""
    return [batch(ctx.rank, salt=i) for i in range(max(1, 3 - ctx.rank))]


def uneven_inputs_broken(ctx, group, scratch):
    model = DDP(mlp(), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in my_batches(ctx):  # rank 0: 3 batches, rank 1: 2
        step(model, opt, x, y)  # rank 0's third backward waits for rank 1's gradients
    dist.barrier(group=group)


def uneven_inputs_fixed(ctx, group, scratch):
    model = DDP(mlp(), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model]):  # a rank that runs out shadows the others' all-reduces
        for x, y in my_batches(ctx):
            step(model, opt, x, y)
    dist.barrier(group=group)


def labels_with_a_fifth_class(ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 1's shard holds the one sample of class 4 (five classes in the data set)."""
    x, y = batch(ctx.rank)
    if ctx.rank == 1:
        y[0] = 4
    return x, y


def rank_crash_broken(ctx, group, scratch):
    model = DDP(mlp(classes=4), process_group=group)  # 4: the classes rank 0 happened to see
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = labels_with_a_fifth_class(ctx)
    step(model, opt, x, y)  # rank 1 raises in its loss; rank 0 waits in backward


def rank_crash_fixed(ctx, group, scratch):
    model = DDP(mlp(classes=5), process_group=group)  # counted over the whole data set
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = labels_with_a_fifth_class(ctx)
    step(model, opt, x, y)


# --- in the launching process, before any process group exists ------------------------------

def port_held_by_another_job() -> socket.socket:
    """Listen on a port the OS picks, as an earlier job's rendezvous would."""
    other_job = socket.socket()
    other_job.bind(("127.0.0.1", 0))
    other_job.listen()
    return other_job


def port_taken_broken(port: int):
    # What init_process_group(init_method="env://") does on rank 0: host the rendezvous store
    # at MASTER_ADDR:MASTER_PORT.  Another job already listens there.
    return dist.TCPStore("127.0.0.1", port, world_size=1, is_master=True,
                         timeout=timedelta(seconds=5))


def port_taken_fixed(port: int):
    # Port 0: the OS picks a free one (torchrun --standalone does the same for you).
    return dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True,
                         timeout=timedelta(seconds=5))


def dist_before_init_broken():
    # A logging helper, called at import time, before init_process_group.
    return f"[rank {dist.get_rank()}] starting"


def dist_before_init_fixed():
    rank = dist.get_rank() if dist.is_initialized() else 0  # not a rank yet: say 0
    return f"[rank {rank}] starting"

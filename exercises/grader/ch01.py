"""Chapter 01: processes and ranks — sharding the data, identical replicas."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from .core import Context, Exercise
from .guard import Mistake


def check_shard(ctx: Context) -> None:
    """Compared with the real thing: DistributedSampler(shuffle=False) over range(n)."""
    for n in (12, 10, 7, 3, 1, 0):
        for world in (1, 2, 3, 4):
            for rank in range(world):
                want = list(DistributedSampler(range(n), num_replicas=world, rank=rank,
                                               shuffle=False)) if n else []
                got = ctx.call(ctx.learner.shard, n, rank, world)
                if list(got) != want:
                    raise Mistake(f"shard({n}, rank={rank}, world_size={world}) = {list(got)}, "
                                  f"DistributedSampler gives {want}. {_shard_cause(got, want, n)}")


def _shard_cause(got, want, n) -> str:
    got = list(got)
    if len(got) < len(want):
        return ("Too few: when the ranks cannot split n evenly, DistributedSampler pads by "
                "repeating the first indices, so every rank takes the same number of steps "
                "(a rank with fewer would leave the others waiting in an all-reduce).")
    if sorted(got) == sorted(want):
        return "The right indices in the wrong order: rank r takes r, r + N, r + 2N, …"
    if got and got == sorted(got) and len(got) > 1 and got[1] == got[0] + 1:
        return "DistributedSampler interleaves (rank r takes r, r + N, …), not contiguous blocks."
    return "Rank r takes indices r, r + N, r + 2N, … of the padded list."


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)  # running_mean / running_var: buffers, not parameters


def _net(rank: int) -> nn.Module:
    torch.manual_seed(rank)
    net = _Net()
    net.bn.running_mean.uniform_()  # buffers differ between ranks too
    return net


def check_broadcast(ctx: Context) -> None:
    net = _net(ctx.rank)
    rank0 = ctx.gather({k: v.clone() for k, v in net.state_dict().items()})[0]
    ctx.call(ctx.learner.broadcast_from_rank0, net)
    for name, tensor in net.state_dict().items():
        if not torch.equal(tensor, rank0[name]):
            kind = "buffer" if name in dict(net.named_buffers()) else "parameter"
            hint = ("buffers count too: module.buffers() (BatchNorm's running statistics)"
                    if kind == "buffer" else "src=0 on every rank: rank 0 is the one that sends")
            raise Mistake(f"rank {ctx.rank}'s {kind} '{name}' is not rank 0's after your "
                          f"broadcast (off by up to {(tensor - rank0[name]).abs().max():.3g}): "
                          f"{hint}")


def check_equal(ctx: Context) -> None:
    cases = [("identical replicas", None, True), ("rank 1's 'fc.bias'[0] one ulp higher", 1,
                                                  False),
             (f"rank {ctx.world_size - 1}'s BatchNorm running_var changed", "buffer", False)]
    for what, change, want in cases:
        net = _net(0)
        if change == 1 and ctx.rank == 1:
            with torch.no_grad():
                net.fc.bias[0] = torch.nextafter(net.fc.bias[0], torch.tensor(1e9))
        if change == "buffer" and ctx.rank == ctx.world_size - 1:
            net.bn.running_var[2] += 1
        got = ctx.call(ctx.learner.replicas_equal, net)
        answers = ctx.gather(bool(got))
        if len(set(answers)) > 1:
            raise Mistake(f"{what}: the ranks disagree ({answers} on ranks 0..N-1): every rank "
                          "must return the same answer; combine the ranks' verdicts with a "
                          "collective")
        if answers[ctx.rank] != want:
            hint = (" A checksum (a sum) can miss a small change: compare the bits."
                    if not want else "")
            if change == "buffer":
                hint = " Buffers are part of the replica too (module.buffers())."
            raise Mistake(f"{what}: replicas_equal returned {got}, expected {want}.{hint}")


EXERCISES = [
    Exercise("01.1", "shard", check_shard, world_sizes=(1,)),
    Exercise("01.2", "broadcast_from_rank0", check_broadcast,
             hang_hint="Every rank must name the same source (src=0): a broadcast in which "
                       "each rank names itself waits forever."),
    Exercise("01.3", "replicas_equal", check_equal),
]

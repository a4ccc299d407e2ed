"""Bugs that DDP itself catches: its constructor and its reducer raise, with a long message.

Each bug is a pair of functions, ``<name>_broken`` and ``<name>_fixed``, called on every rank as
``fn(ctx, group, scratch)``: ``group`` is a fresh process group with a short timeout (a rank
left waiting gives up in seconds), ``scratch`` a directory every rank can write to.  The page
shows the diff between the two; ``catalog.py`` says what each one prints and why.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint


def mlp(classes: int = 4) -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, classes))


def batch(rank: int, n: int = 8, classes: int = 4, salt: int = 0):
    """Rank ``rank``'s own batch: every rank sees different data, as in real training."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(n, 8, generator=g), torch.randint(0, classes, (n,), generator=g)


def train(model: nn.Module, ctx, steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(ctx.rank, salt=step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


# --8<-- [start:two_heads]
class TwoHeads(nn.Module):
    """A trunk and two heads; this run trains head ``a`` only (``b``: an auxiliary task, off)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.head_a = nn.Linear(16, 4)
        self.head_b = nn.Linear(16, 4)

    def forward(self, x):
        return self.head_a(torch.relu(self.trunk(x)))  # head_b gets no gradient
# --8<-- [end:two_heads]


def unused_parameter_broken(ctx, group, scratch):
    model = DDP(TwoHeads())
    train(model, ctx, steps=2)  # the second forward raises


def unused_parameter_fixed(ctx, group, scratch):
    model = DDP(TwoHeads(), find_unused_parameters=True)  # marks head_b ready itself
    train(model, ctx, steps=2)


# --8<-- [start:shared_block]
class SharedBlock(nn.Module):
    """One block applied twice (shared weights), each application under activation checkpointing."""

    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.block, self.head = nn.Linear(8, 8), nn.Linear(8, 4)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        x.requires_grad_()  # reentrant checkpointing needs an input that requires grad
        for _ in range(2):  # the same parameters, in two checkpointed regions
            x = checkpoint(self.block, torch.tanh(x), use_reentrant=self.use_reentrant)
        return self.head(x)
# --8<-- [end:shared_block]


def checkpoint_twice_broken(ctx, group, scratch):
    model = DDP(SharedBlock(use_reentrant=True), find_unused_parameters=True)
    train(model, ctx, steps=1)


def checkpoint_twice_fixed(ctx, group, scratch):
    model = DDP(SharedBlock(use_reentrant=False), find_unused_parameters=True)
    train(model, ctx, steps=1)


def checkpoint_silent_broken(ctx, group, scratch):
    torch.manual_seed(ctx.seed)
    model = DDP(SharedBlock(use_reentrant=True))  # DDP's defaults: no error at all
    return gradient_error(ctx, model)


def checkpoint_silent_fixed(ctx, group, scratch):
    torch.manual_seed(ctx.seed)
    model = DDP(SharedBlock(use_reentrant=False))  # DDP's defaults: no error at all
    return gradient_error(ctx, model)


# --8<-- [start:gradient_error]
def gradient_error(ctx, model: DDP) -> dict:
    """Largest |DDP's averaged gradient − one process's gradient on every rank's batch|."""
    x, y = batch(ctx.rank)
    F.cross_entropy(model(x), y).backward()
    single = SharedBlock(use_reentrant=False)  # the reference: one process, no DDP
    single.load_state_dict(model.module.state_dict())
    xs, ys = zip(*(batch(r) for r in range(ctx.world_size)), strict=True)
    F.cross_entropy(single(torch.cat(xs)), torch.cat(ys)).backward()
    error = max((a.grad - b.grad).abs().max().item()
                for a, b in zip(model.parameters(), single.parameters(), strict=True))
    return {"giveaway": error, "healthy": error < 1e-5,
            "text": f"max |gradient − single process| = {error:.3g}"}
# --8<-- [end:gradient_error]


def my_words(ctx, everyone: bool) -> list[str]:
    corpus = "the cat sat on the mat the cat ate the rat and the dog ran off".split()  # noqa: SIM905
    return corpus if everyone else corpus[ctx.rank::ctx.world_size]


def different_shapes_broken(ctx, group, scratch):
    vocab = sorted(set(my_words(ctx, everyone=False)))  # from this rank's shard only
    model = nn.Embedding(len(vocab), 8)
    DDP(model, process_group=group)  # compares every parameter's shape across ranks


def different_shapes_fixed(ctx, group, scratch):
    vocab = sorted(set(my_words(ctx, everyone=True)))  # from the whole corpus
    model = nn.Embedding(len(vocab), 8)
    DDP(model, process_group=group)  # compares every parameter's shape across ranks


# --8<-- [start:clamp_in_forward]
class ClampInForward(nn.Module):
    """A max-norm style constraint, applied where it looks natural: in forward."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        out = self.net(x)
        with torch.no_grad():
            self.net[2].weight.clamp_(-0.1, 0.1)  # changes a tensor backward still needs
        return out
# --8<-- [end:clamp_in_forward]


def inplace_parameter_broken(ctx, group, scratch):
    model = DDP(ClampInForward())
    train(model, ctx, steps=1)


def inplace_parameter_fixed(ctx, group, scratch):
    model = DDP(mlp())
    train(model, ctx, steps=1)
    with torch.no_grad():  # after the optimizer step: backward is done with the weight
        model.module[2].weight.clamp_(-0.1, 0.1)


def module_prefix_broken(ctx, group, scratch):
    model = DDP(mlp())
    if ctx.rank == 0:
        torch.save(model.state_dict(), scratch / "model.pt")  # keys: module.0.weight, ...
    dist.barrier()
    mlp().load_state_dict(torch.load(scratch / "model.pt"))  # later, for evaluation


def module_prefix_fixed(ctx, group, scratch):
    model = DDP(mlp())
    if ctx.rank == 0:
        torch.save(model.module.state_dict(), scratch / "model.pt")  # keys: 0.weight, ...
    dist.barrier()
    mlp().load_state_dict(torch.load(scratch / "model.pt"))  # later, for evaluation

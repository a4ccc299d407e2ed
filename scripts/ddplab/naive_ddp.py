"""NaiveDDP: data parallelism in its simplest correct form — average every gradient after backward.

The core is four lines (``average_gradients``): after ``loss.backward()``, all-reduce each
gradient and divide by the number of ranks.  ``NaiveDDP`` wraps it the way the tutorials most
readers come from do, with the rough edges taken off:

* the replica check at construction ends the run on *every* rank, naming the parameter and the
  ranks that differ (a check that raises on one rank only leaves the others waiting forever);
* ``no_sync()`` restores whatever state it found, so it nests and survives exceptions.

What it does not do — and ``BucketedDDP`` (``bucketed_ddp.py``) does — is overlap communication
with the backward pass, pack small gradients into a few large messages, broadcast buffers, or
notice a parameter that got no gradient on one rank only (the ranks' collectives then stop
matching: a hang, or worse, two different tensors summed together).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn


def require_process_group(who: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{who} needs a process group: call torch.distributed."
                           "init_process_group first (ddplab.launch does it for you)")


def module_device(module: nn.Module) -> torch.device:
    """Where the model lives: small control tensors (flags) must go there for nccl."""
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


# --8<-- [start:sync_switch]
class GradSyncSwitch:
    """Turn gradient averaging off for a while: gradient accumulation over micro-batches.

    Gradients of several backward passes add up in ``param.grad`` locally; only the last
    micro-batch, run with sync on, pays for communication.
    """

    _do_sync: bool = True

    @property
    def do_sync(self) -> bool:
        return self._do_sync

    def enable_grad_sync(self) -> None:
        self._do_sync = True

    def disable_grad_sync(self) -> None:
        self._do_sync = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """``with model.no_sync(): loss.backward()`` accumulates without communicating."""
        previous, self._do_sync = self._do_sync, False
        try:
            yield
        finally:
            self._do_sync = previous
# --8<-- [end:sync_switch]


# --8<-- [start:check_replicas]
def parameters_differing_from_rank0(module: nn.Module) -> tuple[list[str], list[int]]:
    """Which parameters differ from rank 0's, and on which ranks — the same answer everywhere.

    One flag per (rank, parameter), summed over the ranks: every rank learns the whole
    picture and can raise together, instead of leaving its peers waiting in a collective.
    """
    named = list(module.named_parameters())
    flags = torch.zeros(dist.get_world_size(), len(named), device=module_device(module))
    for i, (_, param) in enumerate(named):
        rank0s = param.detach().clone()
        dist.broadcast(rank0s, src=0)
        flags[dist.get_rank(), i] = float(not torch.equal(param, rank0s))
    dist.all_reduce(flags)
    names = [named[i][0] for i in flags.sum(0).nonzero().flatten().tolist()]
    return names, flags.sum(1).nonzero().flatten().tolist()
# --8<-- [end:check_replicas]


# --8<-- [start:average]
def average_gradients(model: nn.Module) -> None:
    """After ``loss.backward()``: replace every gradient by its average over the ranks."""
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:  # frozen, or unused in this step (on every rank, we hope)
            # Synchronous: on gloo it returns with the sum; on nccl once it is queued on the
            # GPU, and the division below is queued after it (time it with CUDA events).
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad /= world_size
# --8<-- [end:average]


# --8<-- [start:naive]
class NaiveDDP(GradSyncSwitch, nn.Module):
    """Wrap a model; call ``sync_gradients()`` after every ``loss.backward()``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        require_process_group("NaiveDDP")
        self.module = module
        names, ranks = parameters_differing_from_rank0(module)
        if names:
            raise ValueError(
                f"NaiveDDP: the replicas are not identical: {len(names)} parameter(s), first "
                f"{names[0]!r}, differ from rank 0's on rank(s) {ranks}. "
                "Seed every rank the same way before building the model, e.g. "
                "torch.manual_seed(0), or copy rank 0's parameters with dist.broadcast")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def sync_gradients(self) -> None:
        if self.do_sync:  # inside no_sync(): gradients stay local and keep accumulating
            average_gradients(self.module)
# --8<-- [end:naive]

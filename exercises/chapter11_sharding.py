"""Chapter 11 exercises: sharding by hand — ZeRO-1, FSDP's reduce-scatter, the memory ledger.

Grade your work with `make grade-11`: every exercise runs on 3 ranks (gloo on CPU) next to
torch's own ``ZeroRedundancyOptimizer`` and ``fully_shard``, and the results are compared bit for
bit.  Three ranks, not two: with two, a sum of two terms has one order only and halving is exact,
which hides the layout and the divide-first mistakes.
"""

from __future__ import annotations

import math  # noqa: F401 - you will need it

import torch
import torch.distributed as dist  # noqa: F401 - you will need it


def owners(param_sizes: list[int], world_size: int) -> list[int]:
    """Exercise 11.1: which rank owns each parameter under ZeRO-1.

    ``param_sizes[i]`` is parameter i's number of elements (in the model's order); return
    ``owner`` with ``owner[i]`` the rank that keeps parameter i's optimizer state.  The split must
    be ``torch.distributed.optim.ZeroRedundancyOptimizer``'s: it hands whole parameters out one
    by one, each to the rank that owns the fewest elements so far.  In which order it takes them,
    and which rank wins a tie, decide whether your map is the same as torch's.
    """
    raise NotImplementedError("exercise 11.1: the greedy split, largest parameters first")


class ShardedOptimizer:
    """Exercise 11.2: ZeRO-1, ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=...)``.

    The model is wrapped in native DDP, so when ``step()`` is called every rank holds the same
    averaged gradients.  Write:

    * ``__init__``: build ``self.optim = optimizer_class(<the parameters this rank owns>,
      **defaults)`` — the owners from exercise 11.1 — so that optimizer state exists only for
      this rank's share;
    * ``step()``: step ``self.optim``, then make every replica equal again: each parameter's new
      value comes from its owner.

    The parameters after each step must be bit for bit those of DDP + ``ZeroRedundancyOptimizer``.
    """

    def __init__(self, params, optimizer_class, **defaults):
        raise NotImplementedError("exercise 11.2: an optimizer over the parameters you own")

    def step(self) -> None:
        raise NotImplementedError("exercise 11.2: step your share, then share the result")


def reduce_scatter_gradients(grads: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """Exercise 11.3: FSDP's gradient reduction for one unit (a layer), as ``fully_shard`` does it.

    ``grads`` are this rank's full local gradients of the unit's parameters.  Return this rank's
    averaged shard of each: rows ``rank * c`` up to ``(rank + 1) * c`` of dim 0, with
    ``c = ceil(d0 / world_size)`` (what ``torch.chunk`` gives this rank: the last ranks may get
    fewer rows, or none — shape ``(0, ...)``).  Use ONE ``dist.reduce_scatter_single`` with
    ``op=dist.ReduceOp.AVG`` for the whole unit.  The values must be ``fully_shard``'s to the bit,
    and that depends on where each element sits in the message you reduce-scatter.
    """
    raise NotImplementedError("exercise 11.3: pad, lay out, reduce-scatter, cut back")


def rank_bytes(shapes: list[tuple[int, ...]], world_size: int, rank: int,
               stage: int) -> dict[str, int]:
    """Exercise 11.4: the memory ledger — bytes one rank holds, predicted from the shapes alone.

    ``shapes`` are the model's parameter shapes (float32), trained with ``torch.optim.AdamW``,
    one step taken and its gradients still in place.  Return ``{"params": ..., "grads": ...,
    "optimizer_state": ...}`` in bytes (AdamW's two tensors per parameter; its 4-byte ``step``
    counters are not asked for) for:

    * ``stage=0``: native DDP;
    * ``stage=1``: native DDP + ``ZeroRedundancyOptimizer`` (ZeRO-1);
    * ``stage=3``: ``fully_shard`` on every layer (ZeRO-3): FSDP2 stores a rank's dim-0 chunk
      padded to ``ceil(d0 / world_size)`` rows; the optimizer's state is made like the rank's
      real, unpadded shard.

    The grader measures the real thing (the storage of every parameter, gradient and state
    tensor) on each of 3 ranks and compares to the byte.
    """
    raise NotImplementedError("exercise 11.4: the ledger per stage, padding included")

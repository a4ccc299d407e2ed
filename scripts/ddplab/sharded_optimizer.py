"""ShardedOptimizer: ZeRO stage 1 by hand — each rank keeps the optimizer state of its own share.

Under DDP every rank runs the same optimizer on the same averaged gradients, so every rank holds
the whole optimizer state (Adam: two tensors the size of the model) and computes the same update.
ZeRO-1 (Rajbhandari et al., SC 2020, arXiv:1910.02054) splits that work:

1. **Owners.**  Every parameter gets one owner rank.  The split is
   ``ZeroRedundancyOptimizer``'s, exactly (``_partition_parameters`` in
   torch/distributed/optim/zero_redundancy_optimizer.py): per parameter group, parameters sorted
   by size, largest first (a stable sort: equal sizes keep their order), each one given to the
   rank with the fewest elements so far (the first such rank: ``_get_min_index``); the running
   totals carry over from one group to the next.
2. **Step your own.**  Each rank builds ``optimizer_class`` on the parameters it owns only
   (``.optim``), one group per original group, so only those get state and an update.
3. **Share the result.**  Every parameter is broadcast from its owner (``_sync_params``:
   rank by rank, one broadcast per parameter), and every replica is equal again.

Gradients are untouched: DDP still all-reduces all of them (ZeRO-2 shards those too, see
``zero2.py``).  The update of each element is the same arithmetic as an unsharded optimizer's on
the same averaged gradient, so the parameters and the state are bit for bit those of DDP with an
ordinary optimizer, at any world size.

The state dict works as native's: ``consolidate_state_dict(to)`` is a collective that gathers
every rank's state on rank ``to``; ``state_dict()`` on that rank then returns the state of the
whole model in an unsharded optimizer's format (state keyed by the parameter's global index),
and raises anywhere else.  ``load_state_dict`` takes that full dict on every rank and keeps the
entries this rank owns.  Native does more: ``parameters_as_bucket_view`` (one broadcast per rank),
``overlap_with_ddp`` (step inside DDP's comm hook), ``add_param_group`` after construction, Join.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

ParamGroup = dict[str, Any]


# --8<-- [start:partition]
def partition_param_groups(param_groups: list[ParamGroup],
                           world_size: int) -> list[list[ParamGroup]]:
    """For each rank, its share of every group: ``ZeroRedundancyOptimizer``'s greedy split.

    Returns ``per_rank[r]``: a copy of each group whose ``"params"`` are those rank ``r`` owns
    (possibly none).  Sizes count elements, and the totals carry over across groups.
    """
    per_rank: list[list[ParamGroup]] = [[] for _ in range(world_size)]
    totals = [0] * world_size
    for group in param_groups:
        owned: list[list[nn.Parameter]] = [[] for _ in range(world_size)]
        for param in sorted(group["params"], key=lambda p: p.numel(), reverse=True):
            rank = totals.index(min(totals))  # the first rank with the fewest elements so far
            owned[rank].append(param)
            totals[rank] += param.numel()
        for rank in range(world_size):
            per_rank[rank].append({**group, "params": owned[rank]})
    return per_rank
# --8<-- [end:partition]


def partition_parameters(params, world_size: int) -> list[list[nn.Parameter]]:
    """The parameters each rank owns, in the order it was given them: ``params`` is a list of
    tensors or of parameter groups, as an optimizer takes them."""
    per_rank = partition_param_groups(as_param_groups(params), world_size)
    return [[p for group in groups for p in group["params"]] for groups in per_rank]


def as_param_groups(params) -> list[ParamGroup]:
    params = list(params)
    if params and isinstance(params[0], dict):
        return [{**group, "params": list(group["params"])} for group in params]
    return [{"params": params}]


class ShardedOptimizer(Optimizer):
    """ZeRO-1: ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)``.

    The call of ``torch.distributed.optim.ZeroRedundancyOptimizer``.  ``.param_groups`` are the
    full groups (a learning-rate scheduler can change them); ``.optim`` is this rank's optimizer
    on the parameters it owns; ``zero_grad()`` clears every parameter's gradient.
    """

    def __init__(self, params, optimizer_class: type[Optimizer],
                 process_group: dist.ProcessGroup | None = None, **defaults: Any):
        self._initialized = False
        super().__init__(as_param_groups(params), defaults)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.partition = partition_param_groups(self.param_groups, self.world_size)
        self.owner = {p: rank for rank, groups in enumerate(self.partition)
                      for group in groups for p in group["params"]}
        # One group per original group, even an empty one: hyperparameters stay aligned.
        self.optim = optimizer_class(self.partition[self.rank], **defaults)
        copy_hyperparameters(self.optim.param_groups, self.param_groups)  # betas, eps, ...
        self._initialized = True

    def add_param_group(self, param_group: ParamGroup) -> None:
        if self._initialized:  # the split would change, and with it every rank's state
            raise NotImplementedError("ShardedOptimizer: pass every parameter group at "
                                      "construction")
        super().add_param_group(param_group)

    # --8<-- [start:step]
    @torch.no_grad()
    def step(self, closure=None):
        copy_hyperparameters(self.param_groups, self.optim.param_groups)  # a scheduler's lr
        loss = self.optim.step(closure) if closure is not None else self.optim.step()
        copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self.broadcast_from_owners()
        return loss

    def broadcast_from_owners(self) -> None:
        """Every parameter from its owner, rank by rank (native: ``_sync_params``)."""
        handles = []
        for rank, groups in enumerate(self.partition):
            src = dist.get_global_rank(self.group_or_world, rank)
            for param in itertools.chain.from_iterable(g["params"] for g in groups):
                handles.append(dist.broadcast(param.data, src=src, group=self.process_group,
                                              async_op=True))
        for handle in handles:
            handle.wait()
    # --8<-- [end:step]

    @property
    def group_or_world(self) -> dist.ProcessGroup:
        return self.process_group or dist.group.WORLD

    def global_index(self) -> dict[nn.Parameter, int]:
        """Each parameter's index in an unsharded optimizer's state dict."""
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        return {p: i for i, p in enumerate(params)}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: gather every rank's optimizer state on rank ``to`` (copied to the CPU)."""
        index = self.global_index()
        mine = {index[p]: {k: v.cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                for p, s in self.optim.state.items()}
        gathered: list[Any] | None = [None] * self.world_size if self.rank == to else None
        dst = dist.get_global_rank(self.group_or_world, to)
        dist.gather_object(mine, gathered, dst=dst, group=self.process_group)
        self._consolidated = None
        if gathered is not None:
            self._consolidated = dict(sorted(
                (i, s) for states in gathered for i, s in states.items()))

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, as an unsharded optimizer's ``state_dict()``: only on the
        rank that ``consolidate_state_dict(to=...)`` gathered it on, as native, and as it was
        then (consolidate again after more steps)."""
        consolidated = getattr(self, "_consolidated", None)
        if consolidated is None:
            raise RuntimeError(
                f"ShardedOptimizer: rank {self.rank} holds no consolidated state; call "
                f"consolidate_state_dict(to={self.rank}) on every rank first")
        full = super().state_dict()  # the groups, with parameters as global indices
        full["state"] = consolidated
        return full

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (every rank passes the same one): this rank keeps what it owns,
        through ``self.optim.load_state_dict`` so that torch's own loading rules apply."""
        index = self.global_index()
        local: dict[str, Any] = {"state": {}, "param_groups": []}
        position = itertools.count()
        for saved, mine in zip(state_dict["param_groups"], self.optim.param_groups,
                               strict=True):
            ids = []
            for param in mine["params"]:
                ids.append(next(position))
                if index[param] in state_dict["state"]:
                    local["state"][ids[-1]] = state_dict["state"][index[param]]
            local["param_groups"].append({**saved, "params": ids})
        self.optim.load_state_dict(local)
        copy_hyperparameters(self.optim.param_groups, self.param_groups)


def copy_hyperparameters(source: list[ParamGroup], target: list[ParamGroup]) -> None:
    """Everything but the parameters, group by group (native: ``_sync_param_groups``)."""
    for src, dst in zip(source, target, strict=True):
        dst.update({k: v for k, v in src.items() if k != "params"})

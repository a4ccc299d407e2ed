"""FullyShardedDP: FSDP (ZeRO-3) by hand — every parameter sharded, gathered only while in use.

Each rank keeps 1/N of every parameter (dim 0, padded as FSDP2 pads: ``fsdp_layout``), so
``model.parameters()`` are its shards and any torch optimizer steps the shard only.  A *unit*
(each child module with parameters, then the root's own parameters — ``fully_shard`` applied to
each layer and then to the root) is gathered just before its forward, freed after it, gathered
again when its backward starts, and its gradients are reduce-scattered with ``ReduceOp.AVG``
as soon as they are all there.  What FSDP2 does at each point (torch 2.13,
``torch/distributed/fsdp/_fully_shard/``):

* gather: one ``all_gather_single`` per unit into one buffer whose slot r is rank r's input,
  the padded shards copied straight into it (``foreach_all_gather``, ``all_gather_copy_in``),
  then copied out per parameter (``foreach_all_gather_copy_out``) at its own size, padding
  left out (``FSDPParam.init_unsharded_param``); the buffer is freed once copied out;
* free after forward: the full tensors keep their identity (autograd saved them) but their
  storage is resized to 0 (``free_storage``), and re-allocated and re-filled in the pre-backward
  hook on the unit's outputs (``FSDPParamGroup.pre_backward``);
* reduce: the unit's full parameters freed first (``FSDPParamGroup.post_backward`` reshards
  before it reduces), its gradients copied shard-major into one message
  (``foreach_reduce_scatter_copy_in``) and freed (``unsharded_grads.clear()``), one
  ``reduce_scatter_single`` with AVG (``_get_gradient_divide_factors``: AVG for float32 when no
  divide factor is set), and rank r's row viewed back as its shards' ``.grad`` — added to a
  ``.grad`` already there (``foreach_reduce``, ``to_accumulate_grad``);
* finish: a callback queued on autograd's engine in the first pre-backward hook (as
  ``FSDPState._pre_backward`` does, ``_register_root_post_backward_final_callback``) reduces
  what no hook reduced and reshards.

The layout is what makes it bitwise: gloo's reduce-scatter all-reduces the whole message and
keeps a chunk, and an all-reduce adds an element's N terms in an order set by the element's
offset in the message.  Shard-major puts every element where ``fully_shard`` puts it; the flat
parameter-major layout (a DDP bucket) moves it, which changes the sum from 3 ranks on.  gloo's
``ring()`` (``allreduce.cc``) cuts a small message into N chunks and chunk c ends at rank c,
so at 3 ranks it adds chunk 0 as (g1+g2)+g0, chunk 1 as (g2+g0)+g1, chunk 2 as (g0+g1)+g2.
In the tests' model (``Linear(7, 10)`` first, 96 gradient elements in its message at 3 ranks)
the first element to differ is ``0.weight[8, 2]``, owned by rank 2: offset 66 shard-major
(chunk 2: (g0+g1)+g2, as ``fully_shard``), offset 58 parameter-major (chunk 1: (g2+g0)+g1).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from .fsdp_layout import pad_into, padded_rows, shard, shard_major, split_shards, unshard_into


class _Unit:
    """One module's parameters, sharded together: one gather and one reduce-scatter each."""

    def __init__(self, module: nn.Module, names: list[str], group, rank: int, world: int):
        self.module, self.names, self.group = module, names, group
        self.rank, self.world = rank, world
        params = [module.get_parameter(n) for n in names]
        self.shapes = [p.shape for p in params]
        self.padded_numel = sum(padded_rows(s[0], world) * s[1:].numel() for s in self.shapes)
        self.shards = [nn.Parameter(shard(p.detach(), rank, world), p.requires_grad)
                       for p in params]
        self.full = [nn.Parameter(torch.empty_like(p), p.requires_grad) for p in params]
        for f in self.full:
            _free(f)
        self.gathered = False
        self.waiting: set[int] = set()  # full parameters whose gradient has not arrived yet

    def place(self, tensors: list[nn.Parameter]) -> None:
        """Make ``tensors`` the module's parameters (shards between uses, full ones in use)."""
        for name, tensor in zip(self.names, tensors, strict=True):
            owner, _, attr = name.rpartition(".")
            self.module.get_submodule(owner)._parameters[attr] = tensor


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


class FullyShardedDP(nn.Module):
    """ZeRO-3 by hand, bitwise equal to ``fully_shard`` on each child and then the root::

        model = FullyShardedDP(net)                      # net's parameters become shards
        opt = torch.optim.AdamW(model.parameters())      # steps this rank's shards only
        loss_fn(model(x), y).backward()                  # gathers, reduce-scatters, reshards
        opt.step()

    ``reshard_after_forward=False`` keeps each unit gathered from its forward to the end of
    its own backward (one gather per step instead of two: ZeRO-2's traffic, more memory).
    ``no_sync()`` / ``set_requires_gradient_sync(False)`` accumulate full gradients without
    sending them; ``bytes`` counts each collective's whole message on this rank.
    """

    def __init__(self, module: nn.Module, group=None, reshard_after_forward: bool = True):
        super().__init__()
        self.group = group or dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.reshard_after_forward = reshard_after_forward
        self.requires_gradient_sync = True
        self.bytes = {"all_gather": 0, "reduce_scatter": 0}  # whole messages, per rank
        self._backward_started = False
        with torch.no_grad():  # one start for every rank, as DDP makes sure of
            for p in module.parameters():
                dist.broadcast(p, src=dist.get_global_rank(self.group, 0), group=self.group)
        self.units = [_Unit(m, names, self.group, self.rank, self.world)
                      for m, names in _units(module)]
        for unit in self.units:
            unit.place(unit.shards)
            unit.module.register_forward_pre_hook(lambda m, a, u=unit: self._pre_forward(u))
            unit.module.register_forward_hook(lambda m, a, out, u=unit: self._post_forward(u, out))
            for index, full in enumerate(unit.full):
                if full.requires_grad:
                    full.register_post_accumulate_grad_hook(
                        lambda p, u=unit, i=index: self._grad_ready(u, i))
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # --- the gathers --------------------------------------------------------------------------

    # --8<-- [start:gather]
    @torch.no_grad()
    def _gather(self, unit: _Unit) -> None:
        """All-gather the unit's padded shards into one buffer, then copy each full parameter
        out of it (storage re-allocated); the buffer is freed on return."""
        if unit.gathered:
            return
        gathered = unit.shards[0].new_empty(unit.world * unit.padded_numel)
        mine = gathered.view(unit.world, -1)[unit.rank]  # the input is this rank's slot
        pad_into(unit.shards, unit.shapes, unit.world, mine)
        dist.all_gather_single(gathered, mine, group=unit.group)
        self.bytes["all_gather"] += gathered.numel() * gathered.element_size()
        for full in unit.full:
            _alloc(full)
        # Autograd saved the full parameters in forward: refilling them is not a change.
        with torch.autograd._unsafe_preserve_version_counter(tuple(unit.full)):
            unshard_into(gathered, unit.full, unit.world)
        unit.gathered = True
    # --8<-- [end:gather]

    def _reshard(self, unit: _Unit) -> None:
        for full in unit.full:
            _free(full)
        unit.gathered = False

    def _pre_forward(self, unit: _Unit) -> None:
        self._gather(unit)
        unit.place(unit.full)
        unit.waiting = {i for i, f in enumerate(unit.full) if f.requires_grad}

    def _post_forward(self, unit: _Unit, output):
        unit.place(unit.shards)  # between uses, model.parameters() are the shards again
        if self.reshard_after_forward or not torch.is_grad_enabled():  # no backward will free it
            self._reshard(unit)
        if torch.is_grad_enabled():
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad, u=unit: self._pre_backward(u))
        return output

    def _pre_backward(self, unit: _Unit) -> None:
        if not self._backward_started:  # the first hook of this backward
            self._backward_started = True
            torch.autograd.Variable._execution_engine.queue_callback(
                self.finish_gradient_synchronization)
        self._gather(unit)

    # --- the reduce-scatters ------------------------------------------------------------------

    def _grad_ready(self, unit: _Unit, index: int) -> None:
        unit.waiting.discard(index)
        if not unit.waiting:
            self._post_backward(unit)

    def _post_backward(self, unit: _Unit) -> None:
        """The unit's backward is done: free its full parameters, as ``fully_shard`` does in
        either case, then reduce-scatter its gradients (unless sync is off, when the full
        gradients stay to accumulate).  Freeing first, as ``post_backward`` does, keeps the
        full parameters out of the reduce-scatter's memory."""
        self._reshard(unit)
        if self.requires_gradient_sync:
            self._reduce_unit(unit)
        unit.waiting = set()

    def _reduce_unit(self, unit: _Unit) -> None:
        """Reduce-scatter the unit's full gradients into its shards' ``.grad``; the full
        gradients are freed as soon as the message holds them."""
        present = [i for i, f in enumerate(unit.full) if f.grad is not None]
        if not present:
            return
        grads = [unit.full[i].grad for i in present]
        for i in present:
            unit.full[i].grad = None
        shards = self.reduce_scatter(grads, [unit.shapes[i] for i in present], unit.group)
        for i, reduced in zip(present, shards, strict=True):
            target = unit.shards[i]
            if target.grad is None:
                target.grad = reduced
            else:
                target.grad += reduced

    # --8<-- [start:reduce_scatter]
    def reduce_scatter(self, grads: list[torch.Tensor], shapes: list[torch.Size],
                       group) -> list[torch.Tensor]:
        """Averaged shards of ``grads``: FSDP2's shard-major message, one reduce-scatter."""
        message = shard_major(grads, self.world)
        grads.clear()  # the message holds them now: free them before sending (foreach_reduce)
        row = message.new_empty(message.shape[1])
        dist.reduce_scatter_single(row, message.view(-1), op=dist.ReduceOp.AVG, group=group)
        self.bytes["reduce_scatter"] += message.numel() * message.element_size()
        return split_shards(row, shapes, self.rank, self.world)
    # --8<-- [end:reduce_scatter]

    def finish_gradient_synchronization(self) -> None:
        """Reduce what the hooks did not (a unit waits for every parameter's gradient: one that
        got none this backward holds it back), then reshard everything.  Autograd's engine calls
        it when backward ends; calling it again is a no-op."""
        for unit in self.units:
            self._post_backward(unit)
        self._backward_started = False

    # --- gradient accumulation ------------------------------------------------------------------

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """``False``: backward accumulates full gradients and sends nothing (``fully_shard``'s
        switch of the same name); the next backward with ``True`` reduce-scatters the sum once."""
        self.requires_gradient_sync = requires_gradient_sync

    @contextlib.contextmanager
    def no_sync(self):
        previous = self.requires_gradient_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(previous)

    # --- state ----------------------------------------------------------------------------------

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Name -> full parameter (gathered on every rank), plus the module's buffers."""
        full = {}
        for unit in self.units:
            was_gathered = unit.gathered
            self._gather(unit)
            prefix = _prefix(self.module, unit.module)
            full.update({prefix + n: f.detach().clone() for n, f in zip(unit.names, unit.full,
                                                                        strict=True)})
            if not was_gathered:
                self._reshard(unit)
        full.update({n: b.clone() for n, b in self.module.named_buffers()})
        return full


def _units(module: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """Each child with parameters is a unit; the root keeps the parameters no child holds."""
    units, taken = [], set()
    for child in module.children():
        names = [n for n, _ in child.named_parameters()]
        if names:
            units.append((child, names))
            taken.update(id(p) for p in child.parameters())
    own = [n for n, p in module.named_parameters() if id(p) not in taken]
    return units + ([(module, own)] if own else [])


def _prefix(root: nn.Module, sub: nn.Module) -> str:
    if sub is root:
        return ""
    return next(name for name, m in root.named_modules() if m is sub) + "."


def clip_grad_norm_(shards: list[nn.Parameter], max_norm: float, group=None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` across shards: the global norm, not the local one.

    Each rank's squared norm covers its shards only (padding is not part of a shard), so the
    full model's squared norm is their SUM over ranks; every rank then scales by the same
    coefficient (``clip_coef = max_norm / (norm + 1e-6)``, clamped to 1, as torch does).
    """
    grads = [p.grad for p in shards if p.grad is not None]
    norms = [torch.linalg.vector_norm(g) for g in grads]  # float32, as torch computes them
    total = torch.stack(norms).square().sum() if norms else torch.zeros(())  # squared
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    total = total.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total

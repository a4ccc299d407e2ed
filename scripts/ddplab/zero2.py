"""ShardedGradients: ZeRO stage 2 by hand — each rank keeps only its shard of the averaged gradient.

ZeRO-1 (``sharded_optimizer.py``) still all-reduces every gradient and keeps all of them.  ZeRO-2
(Rajbhandari et al., SC 2020, arXiv:1910.02054, section 5.2) notices that a rank only ever reads
the gradients of the part it updates, so:

1. **Buckets, as chapter 05.**  The parameters live in flat buffers laid out by chapter 05's rule
   (``bucketed_ddp.pack`` in reverse definition order with native DDP's caps: 1 MiB for the
   first bucket at the default), each padded with zeros to a multiple of N elements and cut
   into N equal shards.  Rank r owns shard r of every bucket; ``shard_parameters()`` are those
   shards (views into the buffers), and any element-wise torch optimizer built on them keeps
   state for them only.
2. **Reduce-scatter during backward.**  A hook copies each gradient, times 1/N, into its
   bucket's staging buffer (as native DDP divides: reducer.cpp, ``mark_variable_ready_dense``)
   and drops ``param.grad``; a full bucket is reduce-scattered (SUM) asynchronously, straight
   into its shard's ``.grad``, and its staging buffer is freed once that is done.
3. **Update, then all-gather.**  ``optimizer.step()`` updates this rank's shards;
   ``gather_parameters()`` all-gathers every bucket, in place, so every replica is whole again.

Bits.  The update is element-wise, so it is the unsharded optimizer's arithmetic on the same
averaged gradient.  The averaged gradient is DDP's exactly when the reduction adds each element's
N terms in DDP's order.  On gloo a reduce-scatter *is* an all-reduce: ``ProcessGroupGloo.cpp``
(``reduce_scatter_tensor_coalesced``, reached from ``_reduce_scatter_base``) clones the input,
all-reduces the clone and keeps chunk r.  gloo's ring (gloo/allreduce.cc, ``ring``) cuts a
message of n elements into kN segments of ⌈n/(kN)⌉ elements, and the rank where a segment's sum
starts (so the order of its N terms) depends on the segment.  Padding to the next multiple of N
moves no boundary, since ⌈⌈n/N⌉/k⌉ = ⌈n/(kN)⌉ (and k, set by the message's length in bytes
over gloo's largest segment, rounded up to a multiple of N, stays the same by that identity).
So with DDP's bucket layout (its rebuilt one, which this one is when gradients arrive in
reverse definition order) every element gets DDP's bits, at any N.
Pad by one shard more and, from 3 ranks on, elements near a boundary land in another segment
and get their terms in another order: the tests show both.  NCCL's reduce-scatter is a real one,
with its own order.

Bytes.  Per step, per bucket of P padded elements of e bytes, a ring reduce-scatter and a ring
all-gather each send (N-1)/N · P·e bytes from every rank: together DDP's all-reduce, 2(N-1)/N ·
Ψ·e, plus the padding.  On gloo the reduce-scatter sends an all-reduce's worth: 3(N-1)/N in all.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .bucketed_ddp import broadcast_from_rank0, bucket_caps, pack
from .naive_ddp import require_process_group


def padded_length(numel: int, world_size: int) -> int:
    """The bucket's length after padding with zeros to a multiple of ``world_size``."""
    return math.ceil(numel / world_size) * world_size


@dataclass(eq=False)
class ShardedBucket:
    """Some parameters' values in one padded flat buffer; this rank updates ``shard`` of it."""

    names: list[str]
    params: list[nn.Parameter]
    flat: torch.Tensor          # every parameter of the bucket, then zeros: padded length
    shard: nn.Parameter         # this rank's 1/N of ``flat`` (a view: no copy)
    staging: torch.Tensor | None = None  # the gradients, times 1/N, while backward runs
    reduced: torch.Tensor | None = None  # this rank's shard of their sum, once it arrives
    ready: int = 0
    work: dist.Work | None = None


def make_sharded_bucket(named: list[tuple[str, nn.Parameter]], rank: int,
                        world_size: int) -> ShardedBucket:
    names, params = (list(t) for t in zip(*named, strict=True))
    numel = sum(p.numel() for p in params)
    flat = torch.zeros(padded_length(numel, world_size), dtype=params[0].dtype,
                       device=params[0].device)
    offset = 0
    for p in params:  # the parameters become views into the bucket (no second copy)
        flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    shard_len = flat.numel() // world_size
    shard = nn.Parameter(flat[rank * shard_len:(rank + 1) * shard_len])
    return ShardedBucket(names, params, flat, shard)


class ShardedGradients(nn.Module):
    """ZeRO-2 around ``module``::

        model = ShardedGradients(module)    # bucket_cap_mb as native DDP's
        optimizer = torch.optim.AdamW(model.shard_parameters(), lr=1e-3)
        loss_fn(model(x), y).backward()   # gradients reduce-scattered into the shards
        optimizer.step()                  # this rank's shards only
        model.gather_parameters()         # every parameter whole again, on every rank
        optimizer.zero_grad()

    After backward the module's own ``param.grad`` are None: only the shard's gradient is kept.
    A second backward before ``zero_grad()`` adds its averaged gradient to the shard's, as
    autograd accumulates (one reduce-scatter per backward pass).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None):
        super().__init__()
        require_process_group("ShardedGradients")
        self.module = module
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        broadcast_from_rank0(list(module.parameters()))  # same start, as DDP
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        # Native DDP's rebuilt layout: reverse definition order (the order gradients usually
        # arrive in), its caps (1 MiB first, then 25 MiB, when bucket_cap_mb is None).
        layout = pack(list(reversed(named)), list(bucket_caps(bucket_cap_mb)))
        self.buckets = [make_sharded_bucket(g, self.rank, self.world_size) for g in layout]
        self._slot = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._next, self._queued = 0, False
        wrapper = weakref.ref(self)

        def on_grad_ready(param: torch.Tensor) -> None:
            if (me := wrapper()) is not None:
                me._on_grad_ready(param)

        for _, p in named:
            p.register_post_accumulate_grad_hook(on_grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def shard_parameters(self) -> list[nn.Parameter]:
        """This rank's shard of every bucket: what its optimizer updates."""
        return [b.shard for b in self.buckets]

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._queued:  # the first gradient of this backward pass
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._queued = True
        bucket, i = self._slot[param]
        if bucket.staging is None:  # allocated per pass, freed after its reduce-scatter
            bucket.staging = torch.zeros_like(bucket.flat)
        offset = sum(p.numel() for p in bucket.params[:i])
        view = bucket.staging[offset:offset + param.numel()].view_as(param)
        torch.mul(param.grad, 1.0 / self.world_size, out=view)  # DDP's grad * (1/N)
        param.grad = None  # the full gradient is not kept: that is ZeRO-2
        bucket.ready += 1
        self._launch_full_buckets()

    def _launch_full_buckets(self) -> None:
        """Reduce-scatter full buckets strictly in bucket order: the same order on every rank."""
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.ready < len(bucket.params):
                return
            bucket.reduced = torch.empty_like(bucket.shard)
            bucket.work = dist.reduce_scatter_single(bucket.reduced, bucket.staging,
                                                     op=dist.ReduceOp.SUM, async_op=True)
            self._next += 1

    def _finish_backward(self) -> None:
        self._queued = False
        try:
            missing = [b.names[0] for b in self.buckets[self._next:]]
            for bucket in self.buckets[:self._next]:
                bucket.work.wait()  # the shard's gradient is in
                if bucket.shard.grad is None:
                    bucket.shard.grad = bucket.reduced
                else:  # a second backward before zero_grad(): add, as autograd would
                    bucket.shard.grad += bucket.reduced
            if missing:
                raise RuntimeError(
                    f"ShardedGradients: a bucket starting at {missing[0]!r} never filled: every "
                    "parameter that requires grad must get a gradient in every backward pass")
        finally:
            for bucket in self.buckets:
                bucket.staging = bucket.reduced = bucket.work = None
                bucket.ready = 0
            self._next = 0

    # --8<-- [start:gather]
    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Every rank's updated shard into every rank's buffer (in place: this rank's input is
        its own chunk of the output, which NCCL and gloo both accept)."""
        works = [dist.all_gather_single(b.flat, b.shard.detach(), async_op=True)
                 for b in self.buckets]
        for work in works:
            work.wait()
    # --8<-- [end:gather]


def collective_payloads(model: ShardedGradients) -> list[tuple[str, int]]:
    """The collectives of one step and the bytes of the full buffer each one covers."""
    calls = []
    for op in ("reduce_scatter", "all_gather"):
        calls += [(op, b.flat.numel() * b.flat.element_size()) for b in model.buckets]
    return calls


def ring_bytes_sent(op: str, payload: int, world_size: int, gloo: bool = False) -> float:
    """Bytes one rank sends for one collective over a ``payload``-byte buffer, in a ring.
    ``gloo``: its reduce-scatter is an all-reduce of the whole buffer (ProcessGroupGloo.cpp)."""
    share = (world_size - 1) / world_size * payload
    if op == "all_reduce" or (op == "reduce_scatter" and gloo):
        return 2 * share
    return share


def bytes_sent_per_step(model: ShardedGradients, gloo: bool = False) -> float:
    return sum(ring_bytes_sent(op, payload, model.world_size, gloo)
               for op, payload in collective_payloads(model))

"""BucketedDDP: what native DistributedDataParallel does, in readable Python.

Four ideas, each a few lines below:

1. **Same start.**  Rank 0's parameters and buffers are copied to every rank at construction;
   its buffers (BatchNorm statistics) again before a forward that follows a training forward
   (native DDP's ``forward_sync_buffers=True``, the default).
2. **Buckets.**  Gradients are packed into a few flat buffers and each one is all-reduced as one
   message: fewer, larger messages.  The layout is native DDP's, exactly: the first iteration
   uses one bucket per dtype and device, in definition order; after it, the buckets are rebuilt
   in the order the gradients really arrived, capped at ``bucket_cap_mb`` (the first one at
   1 MiB when the cap is left at its default, ``None``).
3. **Overlap.**  A hook on every parameter copies its gradient, times 1/N, into its bucket the
   moment the gradient is accumulated; a full bucket's all-reduce starts *asynchronously* while
   backward goes on.  Buckets are launched strictly in index order, so every rank issues the same
   collectives in the same order.
4. **Done when backward returns.**  A callback that the autograd engine runs after the whole
   backward pass waits for the buckets and copies the averages back into ``param.grad``.

Why the exact layout matters: a ring all-reduce over 3 or more ranks adds an element's
contributions in an order that depends on where the element sits in the message.  With the same
layout as native DDP, every gradient sits at the same offset and gets the same bits, at any world
size.  Sources: torch/nn/parallel/distributed.py (``_BucketCapacityConfig``, ``_pre_forward``)
and torch/csrc/distributed/c10d/reducer.cpp (``compute_bucket_assignment_by_size``,
``rebuild_buckets``, ``mark_variable_ready_dense``); Li et al., VLDB 2020, arXiv:2006.15704.
Native DDP does more: unused-parameter search, comm hooks, mixed precision, Join.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .buckets import (  # noqa: F401  (the packing rule lives in buckets.py; importable here)
    DEFAULT_CAP_MB,
    FIRST_BUCKET_BYTES,
    MiB,
    NamedParams,
    assign_buckets,
    bucket_caps,
    first_iteration_layout,
    pack,
)
from .comm_hooks import run_comm_hook
from .naive_ddp import GradSyncSwitch, module_device, require_process_group
from .run.timeline import Timeline
from .run.tracing import BucketTrace


# --8<-- [start:bucket]
@dataclass(eq=False)
class Bucket:
    """A few parameters' gradients in one flat tensor, all-reduced as one message."""

    index: int
    names: list[str]
    params: list[nn.Parameter]
    flat: torch.Tensor                 # allocated once, reused every iteration
    views: list[torch.Tensor]          # views[i]: params[i]'s slice of flat, shaped like it
    ready: set[int] = field(default_factory=set)  # which params' gradients are in, this pass
    work: dist.Work | None = None      # the in-flight async all-reduce

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def is_full(self) -> bool:
        return len(self.ready) == len(self.params)


def make_bucket(index: int, named_params: NamedParams) -> Bucket:
    names, params = zip(*named_params, strict=True)
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                       device=params[0].device)
    views, offset = [], 0
    for p in params:  # the offset of each gradient in the message: the order matters
        views.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return Bucket(index, list(names), list(params), flat, views)
# --8<-- [end:bucket]


class BucketObserver:
    """What a BucketedDDP reports while it works: pass one as ``observer=`` to watch it without
    touching its logic.  Every method does nothing here; override the ones you need.
    ``bucket_trace.BucketTrace`` is one (each bucket on a timeline, for the figures)."""

    def bucket_launching(self, bucket: Bucket) -> None:
        """``bucket``'s all-reduce (or comm hook) is about to start."""

    def bucket_launched(self, bucket: Bucket) -> None:
        """``bucket.work`` holds its reduction in flight: a ``dist.Work``, or a hook's Future."""

    def backward_finishing(self) -> None:
        """The end-of-backward callback starts: it waits for every bucket."""

    def backward_finished(self) -> None:
        """The end-of-backward callback has returned, or raised."""


@torch.no_grad()
def broadcast_from_rank0(tensors: list[torch.Tensor], coalesce: bool = False) -> None:
    """Copy rank 0's values into ``tensors`` on every rank.  ``coalesce``: one message per dtype
    and device through a flat copy (the small buffers, every forward); else one per tensor (the
    parameters, once: no extra copy of the model)."""
    if not coalesce:
        for t in tensors:
            dist.broadcast(t, src=0)
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.broadcast(flat, src=0)
        for t, value in zip(group, flat.split([t.numel() for t in group]), strict=True):
            t.copy_(value.view_as(t))


class BucketedDDP(GradSyncSwitch, nn.Module):
    """Gradients averaged in buckets, during backward.  Same loop as native DDP.

    ``bucket_cap_mb`` and ``forward_sync_buffers`` mean what they mean for native DDP.
    ``timeline``: record each bucket's all-reduce as a ``comm`` span ``bucket {i}`` and the wait
    at the end of backward as a ``wait`` span.  ``overlap=False`` holds every bucket back until
    backward has finished, to measure what overlapping buys.  ``observer``: a
    ``BucketObserver`` told of every bucket launch and every end of backward.
    ``use_layout(groups, keep=True)`` forces a bucket layout (tests compare one with native's).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None,
                 timeline: Timeline | None = None, *, overlap: bool = True,
                 forward_sync_buffers: bool = True, observer: BucketObserver | None = None):
        super().__init__()
        require_process_group("BucketedDDP")
        if bucket_cap_mb is not None and bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module, self.world_size = module, dist.get_world_size()
        self.caps, self.overlap = bucket_caps(bucket_cap_mb), overlap
        self.forward_sync_buffers = forward_sync_buffers
        # --8<-- [start:construct]
        self._buffers_to_sync = list(module.buffers())
        broadcast_from_rank0([*module.parameters(), *self._buffers_to_sync])  # same start

        self.params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._index = {p: i for i, (_, p) in enumerate(self.params)}
        self._rebuilt, self._arrival_order, self._next_bucket = False, [], 0
        self.use_layout(first_iteration_layout(self.params))
        # --8<-- [end:construct]
        self._finish_queued = self._sync_this_backward = False  # decided in forward
        self._sync_buffers_next = True  # native: decided by the previous forward

        wrapper = weakref.ref(self)  # hooks hold the wrapper weakly: a dropped one does nothing

        def on_grad_ready(param: torch.Tensor) -> None:  # receives the *parameter*
            if (ddp := wrapper()) is not None:
                ddp._on_grad_ready(param)

        for _, param in self.params:
            param.register_post_accumulate_grad_hook(on_grad_ready)
        if timeline is not None:  # for the figures: an observer, see run/tracing.py
            observer = BucketTrace(timeline)
        self.observer = observer if observer is not None else BucketObserver()

    def use_layout(self, groups: list[NamedParams], *, keep: bool = False) -> None:
        """One bucket per group of (name, parameter), gradients at these offsets.  ``keep``:
        never rebuild it (as after native's rebuild); tests force a layout with it."""
        self.buckets = [make_bucket(i, group) for i, group in enumerate(groups)]
        self._slot = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._rebuilt = self._rebuilt or keep

    # [comm hook] native DDP's API: see ddplab/comm_hooks.py
    _comm_hook: tuple | None = None  # (state, hook) once registered

    def register_comm_hook(self, state, hook) -> None:
        """Let ``hook(state, bucket)`` reduce every bucket instead of the built-in average.

        Native DDP's contract: the bucket has ``GradBucket``'s methods, its buffer holds the
        *undivided* gradients, and the hook returns a ``torch.futures.Future`` of the averaged
        buffer.  One hook per model, registered before the first backward, as native.
        """
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once (as native DDP)")
        self._comm_hook = (state, hook)

    # --8<-- [start:forward]
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and not self._rebuilt and self._arrival_order:
            self._rebuild_buckets()  # once, after the first averaging backward (as native)
        if (self._sync_buffers_next and self.forward_sync_buffers and self._buffers_to_sync
                and self.world_size > 1):
            broadcast_from_rank0(self._buffers_to_sync, coalesce=True)  # rank 0's statistics
        # A training forward (autograd on, not inside no_sync) gives a backward that averages
        # the gradients, and makes the *next* forward start from rank 0's buffers: native
        # DDP's rule, so an evaluation right after training uses rank 0's statistics too.
        self._sync_this_backward = self.do_sync and torch.is_grad_enabled()
        self._sync_buffers_next = self._sync_this_backward
        return self.module(*args, **kwargs)
    # --8<-- [end:forward]

    # --8<-- [start:rebuild]
    def _rebuild_buckets(self) -> None:
        """Buckets in the order gradients arrived, capped (native: ``Reducer::rebuild_buckets``).
        Every rank takes rank 0's order (native's ``sync_bucket_indices``): same buckets."""
        order = torch.tensor(self._arrival_order, device=module_device(self.module))
        dist.broadcast(order, src=0)
        self.use_layout(pack([self.params[i] for i in order.tolist()], list(self.caps)), keep=True)
    # --8<-- [end:rebuild]

    # --8<-- [start:on_grad_ready]
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Autograd calls this once ``param.grad`` holds this pass's gradient."""
        if not self._sync_this_backward:
            return  # no_sync(), or no training forward since the last averaging: local only
        if not self._finish_queued:  # the first gradient of this backward pass
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._finish_queued, self._arrived = True, []
        bucket, i = self._slot[param]
        if i in bucket.ready:
            raise RuntimeError(  # native raises too: "mark a variable ready only once"
                f"BucketedDDP: {bucket.names[i]!r} got a gradient twice in one backward pass "
                "(used inside and outside a reentrant torch.utils.checkpoint? pass "
                "use_reentrant=False)")
        # Divide while copying, as native DDP does (mark_variable_ready_dense): grad * (1/N).
        # With a comm hook, copy only: the hook averages (reducer.cpp, same function).
        scale = 1.0 if self._comm_hook is not None else 1.0 / self.world_size
        torch.mul(param.grad.detach(), scale, out=bucket.views[i])
        bucket.ready.add(i)
        self._arrived.append(self._index[param])
        if self.overlap:
            self._launch_full_buckets()
    # --8<-- [end:on_grad_ready]

    # --8<-- [start:launch]
    def _launch_full_buckets(self) -> None:
        """Start the all-reduce of each full bucket, strictly in bucket order: every rank must
        issue the same collectives in the same order, or ranks would sum different buckets."""
        while (self._next_bucket < len(self.buckets)
               and self.buckets[self._next_bucket].is_full()):
            bucket = self.buckets[self._next_bucket]
            self.observer.bucket_launching(bucket)
            if self._comm_hook is not None:  # the hook reduces, and gives a Future to wait on
                last = self._next_bucket == len(self.buckets) - 1
                bucket.work = run_comm_hook(*self._comm_hook, bucket, is_last=last)
            else:
                bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, async_op=True)
            self.observer.bucket_launched(bucket)
            self._next_bucket += 1
    # --8<-- [end:launch]

    # --8<-- [start:finish]
    def _finish_backward(self) -> None:
        """Runs once, after the whole backward pass (the autograd engine calls it)."""
        self._finish_queued = self._sync_this_backward = False  # one forward, one averaging
        self.observer.backward_finishing()
        try:
            self._check_every_gradient_arrived()
            self._launch_full_buckets()  # with overlap=False: all of them, now
            for bucket in self.buckets:  # bucket i is copied back while i + 1 may be in flight
                bucket.work.wait()
                for param, view in zip(bucket.params, bucket.views, strict=True):
                    param.grad.copy_(view)  # the average, back where the optimizer looks
            if not self._rebuilt:
                self._arrival_order = self._arrived  # the next forward rebuilds the buckets
        finally:
            for bucket in self.buckets:
                bucket.ready.clear()
                bucket.work = None
            self._next_bucket = 0
            self.observer.backward_finished()
    # --8<-- [end:finish]

    # --8<-- [start:missing]
    def _check_every_gradient_arrived(self) -> None:
        missing = [b.names[i] for b in self.buckets for i in range(len(b.params))
                   if i not in b.ready]
        if not missing:
            return
        for bucket in self.buckets[:self._next_bucket]:
            bucket.work.wait()  # the launched ones: keeps the ranks' collectives matched
        raise RuntimeError(
            f"BucketedDDP: {len(missing)} parameter(s) got no gradient in this backward "
            f"pass, first {missing[0]!r}, so their bucket can never be all-reduced. "
            "Every parameter that requires grad must contribute to the loss on every "
            "rank: freeze the unused ones with requires_grad_(False) before wrapping")
    # --8<-- [end:missing]


# --8<-- [start:native_buffer_sync]
def native_buffer_sync(enabled: bool = True) -> dict:
    """The keyword that turns native DDP's buffer broadcast before each forward on or off.

    torch 2.13 renamed ``broadcast_buffers`` to ``forward_sync_buffers`` (the old name warns
    with a FutureWarning), and the two differ: ``broadcast_buffers=False`` also skips the
    buffer broadcast at construction; ``forward_sync_buffers=False`` does not.  Older torch
    only knows ``broadcast_buffers``.
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}
# --8<-- [end:native_buffer_sync]

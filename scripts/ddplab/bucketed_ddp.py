"""BucketedDDP: what native DistributedDataParallel does, in readable Python.

Four ideas, each a few lines below:

1. **Same start.**  Rank 0's parameters and buffers are copied to every rank at construction,
   and its buffers (BatchNorm statistics) again at the start of a forward that follows a
   training forward (native DDP's ``broadcast_buffers=True`` rule).
2. **Buckets.**  Gradients are packed, in *reverse* parameter order (roughly the order backward
   produces them), into flat buffers of up to ``bucket_cap_mb`` MiB, allocated once.  One
   all-reduce per bucket instead of one per parameter: fewer, larger messages.
3. **Overlap.**  A hook on every parameter copies its gradient into its bucket the moment the
   gradient is accumulated; a full bucket's all-reduce starts *asynchronously* while backward
   goes on computing earlier layers' gradients.  Buckets are launched strictly in index order,
   so every rank issues the same collectives in the same order.
4. **Done when backward returns.**  The first hook of a backward pass queues a callback on the
   autograd engine; it runs when the whole backward is finished, waits for the buckets, and
   copies the averaged gradients back into ``param.grad``.  The training loop is the same as
   with native DDP: ``loss.backward(); optimizer.step()``.

Read it next to Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training" (VLDB 2020, arXiv:2006.15704) and torch/csrc/distributed/c10d/reducer.cpp.  Native DDP
does more: one bucket for the whole first iteration, then buckets rebuilt in the order the
gradients really arrived (the first one capped at 1 MiB when ``bucket_cap_mb`` is left unset),
unused-parameter search, comm hooks, mixed precision.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .comm_hooks import run_comm_hook
from .naive_ddp import GradSyncSwitch, require_process_group
from .timeline import Timeline

MiB = 2**20


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
    launched_ms: float = 0.0           # for the timeline
    done_ms: float | None = None

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def is_full(self) -> bool:
        return len(self.ready) == len(self.params)


def make_bucket(index: int, named_params: list[tuple[str, nn.Parameter]]) -> Bucket:
    names, params = zip(*named_params, strict=True)
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                       device=params[0].device)
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return Bucket(index, list(names), list(params), flat, views)
# --8<-- [end:bucket]


# --8<-- [start:assign]
def assign_buckets(named_params: list[tuple[str, nn.Parameter]],
                   cap_bytes: int) -> list[list[tuple[str, nn.Parameter]]]:
    """Group parameters into buckets, last parameter first; a bucket closes once it holds
    ``cap_bytes`` or more (native DDP's rule).

    Backward computes the last layer's gradients first, so reversed order puts gradients that
    are ready together into the same bucket.  A parameter is never split, so a bucket can end a
    little over the cap; a tiny cap gives one parameter per bucket.  A bucket holds one dtype on
    one device.
    """
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    current: list[tuple[str, nn.Parameter]] = []
    size = 0
    for name, param in reversed(named_params):
        if current and (param.dtype, param.device) != (current[0][1].dtype, current[0][1].device):
            buckets.append(current)
            current, size = [], 0
        current.append((name, param))
        size += param.numel() * param.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
# --8<-- [end:assign]


@torch.no_grad()
def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """Copy rank 0's values into ``tensors`` on every rank: one message per dtype and device
    (the buffers before every forward: BatchNorm has three small ones per layer)."""
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

    ``timeline``: record each bucket's all-reduce as a ``comm`` span ``bucket {i}`` (with its
    size in bytes) and the wait at the end of backward as a ``wait`` span.
    ``overlap=False`` holds every bucket back until backward has finished, to measure what
    overlapping buys.
    """

    # --8<-- [start:init]
    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, timeline: Timeline | None
                 = None, *, overlap: bool = True):
        super().__init__()
        require_process_group("BucketedDDP")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module = module
        self.timeline = timeline
        self.overlap = overlap
        self.world_size = dist.get_world_size()
        self._buffers_to_sync = list(module.buffers())
        with torch.no_grad():  # rank 0's start for everyone; one tensor at a time: no extra copy
            for tensor in [*module.parameters(), *self._buffers_to_sync]:
                dist.broadcast(tensor, src=0)

        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        groups = assign_buckets(trainable, int(bucket_cap_mb * MiB))
        self.buckets = [make_bucket(i, group) for i, group in enumerate(groups)]
        self._slot = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._next_bucket = 0            # buckets before it are launched, in this pass
        self._finish_queued = False
        self._sync_this_backward = False  # decided in forward, as native DDP does
        self._broadcast_buffers_next = True  # native: decided at the end of the previous forward

        # The hook holds the wrapper weakly: a dropped wrapper's hooks do nothing.
        wrapper = weakref.ref(self)

        def on_grad_ready(param: torch.Tensor) -> None:  # receives the *parameter*, not the grad
            ddp = wrapper()
            if ddp is not None:
                ddp._on_grad_ready(param)

        for _, param in trainable:
            param.register_post_accumulate_grad_hook(on_grad_ready)
    # --8<-- [end:init]

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
        if self._broadcast_buffers_next and self._buffers_to_sync and self.world_size > 1:
            broadcast_from_rank0(self._buffers_to_sync)  # rank 0's BatchNorm statistics for all
        # A training forward (autograd on, not inside no_sync) gives a backward that averages
        # the gradients, and makes the *next* forward start from rank 0's buffers: native
        # DDP's rule, so an evaluation right after training uses rank 0's statistics too.
        self._sync_this_backward = self.do_sync and torch.is_grad_enabled()
        self._broadcast_buffers_next = self._sync_this_backward
        return self.module(*args, **kwargs)
    # --8<-- [end:forward]

    # --8<-- [start:hook]
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """Autograd calls this once ``param.grad`` holds this pass's gradient."""
        if not self._sync_this_backward:
            return  # no_sync(), or no training forward since the last averaging: local only
        if not self._finish_queued:  # the first gradient of this backward pass
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._finish_queued = True
        bucket, i = self._slot[param]
        if i in bucket.ready:
            raise RuntimeError(  # native DDP goes on silently, with unaveraged gradients
                f"BucketedDDP: {bucket.names[i]!r} got a gradient twice in one backward pass "
                "(used inside and outside a reentrant torch.utils.checkpoint? pass "
                "use_reentrant=False)")
        # Copy and divide in one pass, as native DDP does: sum of (grad / N) over N ranks.
        # With a comm hook, copy only: the hook averages (reducer.cpp mark_variable_ready_dense).
        scale = 1.0 if self._comm_hook is not None else 1.0 / self.world_size
        torch.mul(param.grad.detach(), scale, out=bucket.views[i])
        bucket.ready.add(i)
        if self.overlap:
            self._launch_full_buckets()

    def _launch_full_buckets(self) -> None:
        """Start the all-reduce of each full bucket, strictly in bucket order.

        Bucket 3 never starts before bucket 2, even if it fills first: every rank must issue
        the same collectives in the same order, or ranks would sum different buckets together.
        """
        while (self._next_bucket < len(self.buckets)
               and self.buckets[self._next_bucket].is_full()):
            bucket = self.buckets[self._next_bucket]
            if self.timeline is not None:
                bucket.launched_ms, bucket.done_ms = self.timeline.now(), None
            if self._comm_hook is not None:  # [comm hook] the hook reduces; a Future to wait on
                last = self._next_bucket == len(self.buckets) - 1
                bucket.work = run_comm_hook(*self._comm_hook, bucket, is_last=last)
            else:
                bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, async_op=True)
            if self.timeline is not None:
                is_work = hasattr(bucket.work, "get_future")  # a dist.Work, or a hook's Future
                future = bucket.work.get_future() if is_work else bucket.work
                future.add_done_callback(self._completion_recorder(bucket))
            self._next_bucket += 1
    # --8<-- [end:hook]

    # --8<-- [start:finish]
    def _finish_backward(self) -> None:
        """Runs once, after the whole backward pass (the autograd engine calls it)."""
        self._finish_queued = False
        self._sync_this_backward = False  # one forward, one averaging backward (as native)
        started_ms = self.timeline.now() if self.timeline is not None else 0.0
        try:
            missing = [b.names[i] for b in self.buckets
                       for i in range(len(b.params)) if i not in b.ready]
            if missing:
                self._wait_for_buckets(copy_back=False)  # keeps the ranks' collectives matched
                raise RuntimeError(
                    f"BucketedDDP: {len(missing)} parameter(s) got no gradient in this backward "
                    f"pass, first {missing[0]!r}, so their bucket can never be all-reduced. "
                    "Every parameter that requires grad must contribute to the loss on every "
                    "rank: freeze the unused ones with requires_grad_(False) before wrapping")
            self._launch_full_buckets()  # with overlap=False: all of them, now
            self._wait_for_buckets(copy_back=True)
        finally:
            if self.timeline is not None:
                self._record_timeline(started_ms)
            for bucket in self.buckets:
                bucket.ready.clear()
                bucket.work = None
            self._next_bucket = 0

    def _wait_for_buckets(self, copy_back: bool) -> None:
        """Wait for the launched buckets in order.  Bucket i's averages are copied back into
        ``param.grad`` while bucket i + 1 may still be in flight."""
        for bucket in self.buckets[:self._next_bucket]:
            bucket.work.wait()
            if copy_back:
                for param, view in zip(bucket.params, bucket.views, strict=True):
                    param.grad.copy_(view)  # the average, back where the optimizer looks
    # --8<-- [end:finish]

    def _record_timeline(self, started_ms: float) -> None:
        now = self.timeline.now()
        self.timeline.add("wait for buckets", "wait", started_ms, now)
        for bucket in self.buckets[:self._next_bucket]:
            end = bucket.done_ms if bucket.done_ms is not None else now
            self.timeline.add(f"bucket {bucket.index}", "comm", bucket.launched_ms, end,
                              bytes=bucket.nbytes)

    def _completion_recorder(self, bucket: Bucket):
        timeline = self.timeline

        def record(_future) -> None:  # runs on the communication thread when the bucket is done
            bucket.done_ms = timeline.now()
        return record

"""Communication hooks: one API for BucketedDDP and native DDP, and hooks written by hand.

A communication hook replaces the all-reduce of one bucket.  Native DDP's contract
(torch/nn/parallel/distributed.py ``register_comm_hook``; torch/csrc/distributed/c10d/reducer.cpp
``run_comm_hook``): the hook is called as ``hook(state, bucket)`` when a bucket is full, gets a
``GradBucket``, and returns a ``torch.futures.Future`` whose value is the *averaged* flat buffer.
With a hook registered, native DDP copies each gradient into its bucket *without* dividing by the
world size (reducer.cpp ``Reducer::mark_variable_ready_dense``): averaging is the hook's job,
which is why torch's ``allreduce_hook`` divides by the world size itself.

``HookBucket`` gives one of BucketedDDP's buckets the methods native's ``GradBucket`` has (the
pybind in torch/csrc/distributed/c10d/init.cpp: ``index``, ``buffer``, ``gradients``,
``parameters``, ``is_last``, ``set_buffer``), so torch's own hooks run on BucketedDDP unchanged.
Native DDP checks a hook's annotations (distributed.py ``_check_comm_hook``): the second
parameter must be called ``bucket``, and a return annotation must be exactly
``torch.futures.Future[torch.Tensor]``, which a string annotation (``from __future__ import
annotations``) is not; so the hooks below leave their return type unannotated.
``count_bytes`` counts what a hook hands to ``all_reduce``: measured, not assumed.
PowerSGD, the low-rank hook, is in ``powersgd.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

Hook = Callable[[object, "HookBucket"], torch.futures.Future]


# --8<-- [start:bucket]
class HookBucket:
    """What a hook sees of one bucket: the methods of native DDP's ``GradBucket``."""

    def __init__(self, index: int, flat: torch.Tensor, views: list[torch.Tensor],
                 params: list[torch.Tensor], is_last: bool):
        self._index, self._buffer, self._views = index, flat, views
        self._params, self._is_last = params, is_last

    def index(self) -> int:
        return self._index             # 0 is the bucket launched first (the last layers)

    def buffer(self) -> torch.Tensor:
        return self._buffer            # the flat gradients, *not* divided by the world size

    def gradients(self) -> list[torch.Tensor]:
        return list(self._views)       # views into buffer(), shaped like the parameters

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._is_last           # the last bucket of this backward pass

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor          # as native: what later buffer() calls return
# --8<-- [end:bucket]


# --8<-- [start:run_hook]
def run_comm_hook(state, hook: Hook, bucket, is_last: bool) -> torch.futures.Future:
    """Start ``hook`` on one of BucketedDDP's buckets; the returned future's ``wait()`` leaves
    the averaged gradients in ``bucket.flat``, where BucketedDDP copies them back from."""
    view = HookBucket(bucket.index, bucket.flat, bucket.views, bucket.params, is_last)
    future = hook(state, view)
    if not isinstance(future, torch._C.Future):  # torch.futures.Future, or what Work gives
        raise TypeError(f"a communication hook must return a torch.futures.Future, "
                        f"got {type(future).__name__}")

    def write_back(done: torch.futures.Future) -> torch.Tensor:
        result = done.value()                     # a tensor, or a list of one (as native allows)
        result = result[0] if isinstance(result, (list, tuple)) else result
        if result.data_ptr() != bucket.flat.data_ptr():
            bucket.flat.copy_(result)             # a hook may return a new tensor
        return bucket.flat
    return future.then(write_back)
# --8<-- [end:run_hook]


def completed(tensor: torch.Tensor) -> torch.futures.Future:
    """A future that is already done: for hooks that finish their work before returning."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


# --- hooks written by hand ---------------------------------------------------------------------

# --8<-- [start:allreduce]
def allreduce_hook(group: dist.ProcessGroup | None, bucket):  # -> Future (see below)
    """Plain averaging, what DDP does without a hook: divide, then sum over the ranks."""
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])
# --8<-- [end:allreduce]


# --8<-- [start:compress]
def cast_hook(dtype: torch.dtype) -> Hook:
    """A hook that sends the gradients as ``dtype`` (float16 or bfloat16): half the bytes.

    Cast first, then divide, in the small type, as torch's fp16_compress_hook does (the same
    operations in the same order give the same bits).  The sum arrives in ``dtype`` and is
    copied back into the float32 buffer: the precision lost in the cast is lost for good.
    """
    def hook(group: dist.ProcessGroup | None, bucket):
        buffer = bucket.buffer()
        small = buffer.to(dtype).div_(dist.get_world_size(group))
        work = dist.all_reduce(small, group=group, async_op=True)

        def decompress(done: torch.futures.Future) -> torch.Tensor:
            return buffer.copy_(done.value()[0])   # back to float32, in place
        return work.get_future().then(decompress)
    hook.__name__ = f"{str(dtype).removeprefix('torch.')}_hook"
    return hook


fp16_hook = cast_hook(torch.float16)
bf16_hook = cast_hook(torch.bfloat16)
# --8<-- [end:compress]


# --- counting what goes to the wire ----------------------------------------------------------

@dataclass
class ByteCount:
    calls: int = 0
    payload_bytes: int = 0   # bytes handed to all_reduce, summed over calls

    def wire_bytes(self, world: int) -> float:
        """Bytes each rank sends in a ring all-reduce of that payload: 2(N-1)/N of it."""
        return self.payload_bytes * 2 * (world - 1) / world if world > 1 else 0.0


@contextmanager
def count_bytes() -> Iterator[ByteCount]:
    """Count every ``torch.distributed.all_reduce`` call made inside (torch's hooks and ours
    call it through the module attribute, so wrapping the attribute sees them all)."""
    count, original = ByteCount(), dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        count.calls += 1
        count.payload_bytes += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)
    dist.all_reduce = counting_all_reduce
    try:
        yield count
    finally:
        dist.all_reduce = original

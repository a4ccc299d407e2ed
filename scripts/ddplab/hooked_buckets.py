"""Chapter 04's teaching core: gradients averaged in buckets, launched from autograd hooks.

Not a DDP (chapter 05 builds one): no forward, no replica check, no timeline — only the three
moves native DDP makes during backward, in the smallest code that runs:

1. pack the parameters into buckets, in *reverse* order, so the first bucket holds the
   gradients that backward produces first (native's layout after its rebuild, for a model whose
   gradients arrive in reverse definition order; the rule is ``ddplab.buckets``);
2. on each parameter's post-accumulate-grad hook, copy its gradient (times 1/N) into its bucket,
   and when a bucket is complete, start its all-reduce without waiting (``async_op=True``);
3. once the last bucket is launched, ask autograd for a callback at the end of backward that
   waits for every bucket and writes the averages back into ``param.grad``.

Native DDP does the same in C++ (torch/csrc/distributed/c10d/reducer.cpp): its hook is a post
hook on each parameter's AccumulateGrad node (``Reducer::autograd_hook``), it multiplies by 1/N
while copying (``mark_variable_ready_dense``), and it queues its callback once the last bucket
is marked ready (``mark_variable_ready``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .buckets import pack_positions


# --8<-- [start:pack]
def reverse_order_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Last parameter first, packed by native DDP's rule (``ddplab.buckets``): a bucket closes
    once it holds ``cap_bytes`` or more, so it may end a little over the cap."""
    backward_order = list(reversed(params))  # backward produces the last layers' gradients first
    items = [((p.dtype, p.device), p.numel() * p.element_size()) for p in backward_order]
    return [[backward_order[i] for i in bucket] for bucket in pack_positions(items, [cap_bytes])]
# --8<-- [end:pack]


# --8<-- [start:state]
class HookedBuckets:
    """Average the gradients of ``params`` over all ranks, bucket by bucket, during backward."""

    def __init__(self, params: list[nn.Parameter], cap_bytes: int):
        self.buckets = reverse_order_buckets(list(params), cap_bytes)
        self.flat = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype,
                                 device=b[0].device) for b in self.buckets]
        self.where = {}  # parameter -> (bucket index, offset in that bucket's flat tensor)
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                self.where[p] = (i, offset)
                offset += p.numel()
        self.launch_log: list[int] = []  # bucket indices, in the order they were launched
        self._reset()
        for p in self.where:
            p.register_post_accumulate_grad_hook(self.on_grad_ready)

    def _reset(self) -> None:
        self.missing = [len(b) for b in self.buckets]  # gradients each bucket still waits for
        self.next_bucket, self.works = 0, []
    # --8<-- [end:state]

    # --8<-- [start:hook]
    def on_grad_ready(self, param: nn.Parameter) -> None:  # receives the parameter, not the grad
        i, offset = self.where[param]
        view = self.flat[i][offset:offset + param.numel()]
        torch.mul(param.grad.reshape(-1), 1 / dist.get_world_size(), out=view)  # 1/N, then sum
        self.missing[i] -= 1
        # Launch in index order only: ranks match collectives by call order, not by name.
        while self.next_bucket < len(self.buckets) and self.missing[self.next_bucket] == 0:
            work = dist.all_reduce(self.flat[self.next_bucket], async_op=True)  # don't wait
            self.works.append(work)
            self.launch_log.append(self.next_bucket)
            self.next_bucket += 1
        if self.next_bucket == len(self.buckets):  # the last bucket is on its way
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
    # --8<-- [end:hook]

    # --8<-- [start:finish]
    def finish(self) -> None:
        """Runs once, when the whole backward is done: before loss.backward() returns."""
        for work in self.works:
            work.wait()
        for p, (i, offset) in self.where.items():
            p.grad.copy_(self.flat[i][offset:offset + p.numel()].view_as(p.grad))
        self._reset()  # ready for the next backward
    # --8<-- [end:finish]

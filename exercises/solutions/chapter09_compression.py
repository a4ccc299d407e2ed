"""Chapter 09 solutions: an fp16 hook and error feedback.  `make grade-09 FILE=<this file>`.

The hook follows torch's fp16_compress_hook step for step (torch/distributed/algorithms/
ddp_comm_hooks/default_hooks.py ``_compress_hook``): cast, divide in float16, all-reduce, copy
back.  The same operations in the same order give the same bits, which is what the grader checks
at 2 ranks.  No annotations on the hook: native DDP refuses a string return annotation
(distributed.py ``_check_comm_hook``), and ``from __future__ import annotations`` makes every
annotation a string.
"""

import torch
import torch.distributed as dist


# --8<-- [start:hook]
def fp16_compress_hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()                  # float32, this rank's gradients, undivided
    # Divide after the cast, before the sum: the sum of N halves cannot overflow float16
    # where the gradients did not, and the order is torch's (so are the bits).
    small = buffer.to(torch.float16).div_(group.size())
    work = dist.all_reduce(small, group=group, async_op=True)  # returns at once

    def decompress(done: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(done.value()[0])  # back to float32, in place: no new memory

    return work.get_future().then(decompress)  # DDP waits on it at the end of backward
# --8<-- [end:hook]


# --8<-- [start:feedback]
def compress_with_error_feedback(tensor: torch.Tensor, residual: torch.Tensor,
                                 dtype: torch.dtype = torch.float16):
    corrected = tensor + residual             # what this step should have sent, lost bits too
    compressed = corrected.to(dtype)          # what the wire carries
    new_residual = corrected - compressed.to(tensor.dtype)  # what the cast lost: sent next step
    return compressed, new_residual
# --8<-- [end:feedback]

"""Mistake: waits for the all-reduce inside the hook and returns the tensor, not a Future; and
a residual with the wrong sign."""

import torch
import torch.distributed as dist

from exercises.solutions.chapter09_compression import compress_with_error_feedback as right


def fp16_compress_hook(process_group, bucket):
    buffer = bucket.buffer()
    small = buffer.to(torch.float16).div_(dist.get_world_size(process_group))
    dist.all_reduce(small, group=process_group)  # blocks: nothing overlaps with backward
    return buffer.copy_(small)


def compress_with_error_feedback(tensor, residual, dtype=torch.float16):
    compressed, new_residual = right(tensor, residual, dtype)
    return compressed, -new_residual  # compressed - (tensor + residual)

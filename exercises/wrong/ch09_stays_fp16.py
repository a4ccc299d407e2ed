"""Mistake: returns the float16 sum without decompressing it into the bucket's float32 buffer;
and a residual kept in float16."""

import torch
import torch.distributed as dist


def fp16_compress_hook(process_group, bucket):
    small = bucket.buffer().to(torch.float16).div_(dist.get_world_size(process_group))
    work = dist.all_reduce(small, group=process_group, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])  # still float16


def compress_with_error_feedback(tensor, residual, dtype=torch.float16):
    compressed = (tensor + residual).to(dtype)
    return compressed, (tensor + residual).to(dtype) - compressed  # float16: always 0

"""Mistake: compresses and all-reduces, but forgets that with a hook DDP leaves the dividing to
the hook; and error feedback that never adds the residual back."""

import torch
import torch.distributed as dist


def fp16_compress_hook(process_group, bucket):
    buffer = bucket.buffer()
    small = buffer.to(torch.float16)  # no .div_(world size): a SUM, not an average
    work = dist.all_reduce(small, group=process_group, async_op=True)
    return work.get_future().then(lambda done: buffer.copy_(done.value()[0]))


def compress_with_error_feedback(tensor, residual, dtype=torch.float16):
    compressed = tensor.to(dtype)  # the residual is never sent
    return compressed, tensor + residual - compressed.float()

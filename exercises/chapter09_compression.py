"""Chapter 09 exercises: a communication hook of your own, and error feedback.

Grade your work with `make grade-09`: your hook is registered on torch's DistributedDataParallel
AND on the book's BucketedDDP, on 2 and 3 ranks (gloo on CPU), and its gradients are compared
with those of torch's own ``fp16_compress_hook``, bit for bit at 2 ranks.

No ``from __future__ import annotations`` here, and the hook has no annotations: native DDP
checks a hook's annotations (torch/nn/parallel/distributed.py ``_check_comm_hook``) and refuses a
return annotation that is a string, which is what that import turns every annotation into.
"""

import torch
import torch.distributed as dist  # noqa: F401 - you will need it


def fp16_compress_hook(process_group, bucket):
    """Exercise 09.1: a communication hook that sends the gradients as float16.

    Called by DDP as ``hook(process_group, bucket)`` when a bucket is full (``process_group``
    is None for the default group).  ``bucket.buffer()`` is a flat float32 tensor holding this
    rank's gradients, NOT divided by the world size: averaging is the hook's job.  Write:

    * compress: cast the buffer to ``torch.float16`` (half the bytes);
    * divide by the world size (in float16, as torch's hook does), and all-reduce (SUM) it;
    * decompress: copy the result back into the bucket's buffer (its dtype, float32);
    * return a ``torch.futures.Future`` whose value is that averaged buffer, without waiting:
      ``dist.all_reduce(..., async_op=True).get_future().then(...)``.
    """
    raise NotImplementedError("exercise 09.1: cast to fp16, divide, all-reduce, cast back")


def compress_with_error_feedback(tensor: torch.Tensor, residual: torch.Tensor,
                                 dtype: torch.dtype = torch.float16):
    """Exercise 09.2: what a compressing hook sends, with error feedback.

    ``tensor`` is this step's gradient (float32), ``residual`` what compression lost at the
    previous step (float32, zeros at the first).  Return ``(compressed, new_residual)``:

    * ``compressed``: ``tensor + residual`` cast to ``dtype`` (what goes on the wire);
    * ``new_residual``: what that cast lost, ``(tensor + residual) - compressed``, in the
      gradient's dtype, to be added back at the next step.

    Leave ``tensor`` and ``residual`` unchanged.  Over many steps nothing is lost: the sum of what
    was sent plus the last residual is the sum of the gradients, even for gradients smaller than
    float16 can represent (they reach the wire once their residual has grown large enough).
    """
    raise NotImplementedError("exercise 09.2: add the residual, cast, keep what the cast lost")

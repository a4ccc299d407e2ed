"""Chapter 09: an fp16 communication hook of your own, on native DDP and on BucketedDDP.

09.1 is checked twice: the hook alone on one bucket (what it returns, in which dtype, how it
differs from torch's ``default_hooks.fp16_compress_hook`` on the same gradients), then registered
on native ``DistributedDataParallel`` and on the book's ``BucketedDDP`` for two backward passes,
next to native DDP running torch's hook.

How the results are compared:

* at 2 ranks, bit for bit with torch's hook.  Its steps are cast, divide in float16, all-reduce;
  dividing by 2 is exact in binary floating point, so the other orders (divide in float32 before
  the cast, or after the sum) give the same bits too, except for gradients below float16's
  normal range (|g| < 6.1e-05, where float16 has fewer bits and halving rounds), or a sum that
  overflows float16 (> 65504).  The bucket holds such tiny gradients on purpose, so that a
  different order shows, and the message says which order was used;
* at 3 ranks, dividing by 3 rounds, so where it happens changes the last bit: the result is
  compared with the exact mean (float64) within what float16 can round: one rounding in the
  cast, one in the division, N - 1 in the sum, each at most u·|value| (u = 2^-11, float16's unit
  roundoff) plus 2^-25 below the normal range: (N + 1)·u·Σ|g_i| / N + 2N·2^-25 in all (first
  order; 1 % added for the second).  Forgetting to divide misses by a factor of 3.
"""

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as NativeDDP

from .core import REPO, Context, Exercise
from .guard import Mistake

sys.path.insert(0, str(REPO / "scripts"))  # the book's library: BucketedDDP, HookBucket
from ddplab import BucketedDDP
from ddplab.comm_hooks import HookBucket, count_bytes

U16 = torch.finfo(torch.float16).eps / 2        # 2^-11
TINY = 2.0 ** -25                               # half float16's smallest subnormal step
NORMAL16 = torch.finfo(torch.float16).tiny      # 6.1e-05: below it, float16 has fewer bits


def bucket_gradients(rank: int) -> torch.Tensor:
    """A rank's flat float32 gradients: ordinary ones, then tiny ones (below 6.1e-05)."""
    gen = torch.Generator().manual_seed(90 + rank)
    ordinary = torch.randn(768, generator=gen) * 0.05
    sign = torch.randint(0, 2, (256,), generator=gen) * 2 - 1
    tiny = sign * 10 ** (torch.rand(256, generator=gen) * 3.2 - 8.0)  # 1e-8 .. 1.6e-5
    return torch.cat([ordinary, tiny]).float()


def run_on_bucket(ctx: Context, hook, grads: torch.Tensor, learner: bool):
    """(the Future's value, the buffer afterwards, bytes handed to all_reduce) for one bucket."""
    buffer = grads.clone()
    bucket = HookBucket(0, buffer, [buffer], [torch.zeros_like(buffer)], is_last=True)
    with count_bytes() as sent:
        future = ctx.call(hook, None, bucket) if learner else hook(None, bucket)
        if not isinstance(future, torch._C.Future):
            dist.barrier()  # the others may have waited on theirs: keep the ranks in step
            raise Mistake(f"your hook returned a {type(future).__name__}, not a "
                          "torch.futures.Future: DDP starts a bucket's hook and moves on to the "
                          "next bucket, and waits on the Future only at the end of backward. "
                          "Return dist.all_reduce(..., async_op=True).get_future().then(...)")
        value = future.wait()
    value = value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value
    dist.barrier()
    return value, buffer, sent.payload_bytes


# ---------------------------------------------------------------- 09.1 the hook alone
def check_hook_alone(ctx: Context, hook) -> None:
    world, grads = ctx.world_size, bucket_gradients(ctx.rank)
    everyone = ctx.gather(grads)
    value, buffer, sent = run_on_bucket(ctx, hook, grads, learner=True)
    theirs, _, _ = run_on_bucket(ctx, default_hooks.fp16_compress_hook, grads, learner=False)
    others = other_orders(grads, world)   # every rank computes them: they are collectives
    if not isinstance(value, torch.Tensor):
        raise Mistake(f"your Future's value is a {type(value).__name__}: it must be the "
                      "averaged bucket, one tensor shaped like bucket.buffer()")
    if value.shape != grads.shape:
        raise Mistake(f"your Future holds a tensor of shape {tuple(value.shape)}; the bucket's "
                      f"buffer has shape {tuple(grads.shape)}")
    if value.dtype != grads.dtype:
        raise Mistake(f"your Future holds {value.dtype}, the bucket is {grads.dtype}: "
                      "decompress after the all-reduce: copy the float16 sum back into the "
                      "bucket's buffer (buffer.copy_(fut.value()[0])) and return that buffer, "
                      "as torch's fp16_compress_hook does")
    if sent > grads.numel() * 2:
        raise Mistake(f"your hook handed {sent} bytes to all_reduce for {grads.numel()} "
                      f"gradients ({sent / grads.numel():.0f} per gradient): compress BEFORE "
                      "the all-reduce, so that the wire carries float16 (2 bytes each)")
    if world == 2 and torch.equal(value, theirs):
        return
    if world > 2 and within_fp16_rounding(value, everyone):
        return
    raise Mistake(explain_hook(ctx, value, buffer, grads, theirs, others))


def other_orders(grads: torch.Tensor, world: int) -> dict[str, torch.Tensor]:
    """What the usual mistakes give, computed with the same all-reduce, for the message."""
    def reduce(t):
        dist.all_reduce(t)
        return t
    small = grads.to(torch.float16)
    return {
        "no divide": reduce(small.clone()).float(),
        "divide first": reduce((grads / world).to(torch.float16)).float(),
        "divide after": reduce(small.clone()).div_(world).float(),
    }


def within_fp16_rounding(value: torch.Tensor, everyone: list[torch.Tensor]) -> bool:
    terms = torch.stack([g.double() for g in everyone])
    world = len(everyone)
    exact = terms.sum(0) / world
    bound = 1.01 * (world + 1) * U16 * terms.abs().sum(0) / world + 2 * world * TINY
    return bool(((value.double() - exact).abs() <= bound).all())


def explain_hook(ctx, value, buffer, grads, theirs, others) -> str:
    world = ctx.world_size
    wrong = (value != theirs).nonzero()
    i = int(wrong[0]) if len(wrong) else 0
    head = (f"rank {ctx.rank}, element {i} of the bucket: {value[i].item():.6g}, torch's "
            f"fp16_compress_hook gives {theirs[i].item():.6g}")
    tiny = grads.abs() < NORMAL16
    if torch.equal(value, grads):
        what = ("the buffer itself, unchanged" if value.data_ptr() == buffer.data_ptr()
                else "this rank's own gradients")
        return (f"{head}. Your Future holds {what}, not the average: the all-reduced float16 "
                "tensor never went back into the bucket. Copy it in (buffer.copy_(...)) in the "
                "callback you pass to .then(), and return the buffer from it")
    if torch.allclose(value, others["no divide"], rtol=1e-3, atol=1e-6):
        return (f"{head}. Gradients are {world}× torch's fp16 hook: did you divide by the world "
                "size? (with a hook registered, DDP leaves the dividing to the hook)")
    if torch.equal(value, others["divide first"]):
        return (f"{head}. Only gradients below float16's normal range ({NORMAL16:.2g}) differ: "
                "you divided in float32 before the cast; torch casts first and divides in "
                "float16 (two roundings of a tiny value instead of one). Same math, other bits: "
                "cast, then divide, then all-reduce")
    if torch.equal(value, others["divide after"]):
        return (f"{head}. You divided after the all-reduce: then the float16 sum of N gradients "
                "can overflow (float16 ends at 65504) before you divide, and tiny gradients "
                "round differently. Torch divides before the all-reduce: cast, divide, all-reduce")
    off = (value.double() - theirs.double()).abs()
    where = "the tiny gradients only" if bool((off[~tiny] == 0).all()) else "ordinary gradients"
    return f"{head}. Off by {off.max().item():.3g} at most, in {where}."


# ---------------------------------------------------------------- 09.1 on both DDPs
def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)


def register(ctx, ddp, hook, which: str) -> None:
    try:
        ctx.call(ddp.register_comm_hook, None, hook)
    except KeyError:  # native looks the parameter up by name: signature(hook).parameters["bucket"]
        raise Mistake(f"{which} refused your hook: its second parameter must be called `bucket` "
                      "(distributed.py _check_comm_hook looks it up by that name)") from None
    except (ValueError, TypeError) as error:
        why = str(error).rstrip(".")
        raise Mistake(f"{which} refused your hook: {why}. Leave the hook unannotated, or "
                      "annotate exactly `bucket: dist.GradBucket` and `-> torch.futures.Future"
                      "[torch.Tensor]` without `from __future__ import annotations` (it turns "
                      "annotations into strings, which native's check does not accept)"
                      ) from None


def check_on_both_ddps(ctx: Context, hook) -> None:
    torch.manual_seed(9)  # the same start on every rank
    start = make_model()
    models = {name: copy.deepcopy(start) for name in ("native", "bucketed", "torch")}
    ddps = {"native": NativeDDP(models["native"], bucket_cap_mb=0.001),
            "bucketed": BucketedDDP(models["bucketed"], bucket_cap_mb=0.001),
            "torch": NativeDDP(models["torch"], bucket_cap_mb=0.001)}
    register(ctx, ddps["native"], hook, "native DistributedDataParallel")
    register(ctx, ddps["bucketed"], hook, "BucketedDDP")
    ddps["torch"].register_comm_hook(None, default_hooks.fp16_compress_hook)
    for step in range(2):  # the second step: buckets rebuilt in the order gradients arrived
        x, y = batch(ctx.rank, step)
        for name, ddp in ddps.items():
            for p in models[name].parameters():
                p.grad = None
            loss = nn.functional.mse_loss(ddp(x), y)
            if name == "torch":
                loss.backward()
            else:
                ctx.call(loss.backward)  # the learner's hook runs in here
        local = local_gradients(ctx, start, x, y)
        for name in ("native", "bucketed"):
            compare_with_torch(ctx, models[name], models["torch"], local,
                               f"on {'native DDP' if name == 'native' else 'BucketedDDP'}, "
                               f"step {step + 1}")


def local_gradients(ctx, start, x, y) -> list[dict[str, torch.Tensor]]:
    """Every rank's own gradient for this batch (no DDP): what the hook averages."""
    twin = copy.deepcopy(start)
    nn.functional.mse_loss(twin(x), y).backward()
    return ctx.gather({n: p.grad.clone() for n, p in twin.named_parameters()})


def compare_with_torch(ctx, mine: nn.Module, torchs: nn.Module, local: list[dict], when: str):
    world = ctx.world_size
    for (name, p), q in zip(mine.named_parameters(), torchs.parameters(), strict=True):
        got, want = p.grad, q.grad
        if world == 2:
            ok = torch.equal(got, want)
        else:
            ok = within_fp16_rounding(got.view(-1), [g[name].view(-1) for g in local])
        if ok:
            continue
        i = int((got != want).view(-1).nonzero()[0]) if (got != want).any() else 0
        head = (f"{when}: rank {ctx.rank}, parameter '{name}', element {i}: gradient "
                f"{got.view(-1)[i]:.6g}, torch's fp16 hook gives {want.view(-1)[i]:.6g}")
        own = local[ctx.rank][name]
        if torch.allclose(got, want * world, rtol=1e-2, atol=1e-6):
            raise Mistake(f"{head}. Gradients are {world}× torch's fp16 hook: did you divide "
                          "by the world size?")
        if torch.equal(got, own):
            raise Mistake(f"{head}. It is this rank's own gradient: the average never reached "
                          "DDP (return a Future of the averaged buffer)")
        raise Mistake(f"{head}. Off by {(got - want).abs().max():.3g} at most.")


def check_fp16_hook(ctx: Context) -> None:
    hook = ctx.learner.fp16_compress_hook
    check_hook_alone(ctx, hook)
    check_on_both_ddps(ctx, hook)


# ---------------------------------------------------------------- 09.2 error feedback
def check_error_feedback(ctx: Context) -> None:
    fn = ctx.learner.compress_with_error_feedback
    gen = torch.Generator().manual_seed(5)
    residual = torch.zeros(512)
    drip = torch.full((512,), 2e-8)  # below float16's smallest step: plain fp16 sends 0
    for step in range(40):
        grad = torch.randn(512, generator=gen) * 0.01 if step < 3 else drip.clone()
        grad_in, residual_in = grad.clone(), residual.clone()
        out = ctx.call(fn, grad, residual)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise Mistake("return a pair: (compressed, new_residual)")
        compressed, new_residual = out
        if not torch.equal(grad, grad_in) or not torch.equal(residual, residual_in):
            raise Mistake("your function changed its inputs in place: the hook still needs the "
                          "gradient; return new tensors instead")
        explain_feedback(step, grad, residual, compressed, new_residual)
        residual = new_residual  # the next step adds it back: the 2e-8 drip reaches the wire


def explain_feedback(step, grad, residual, compressed, new_residual) -> None:
    corrected = grad + residual
    want_c = corrected.to(torch.float16)
    want_r = corrected - want_c.float()
    at = f"step {step + 1}"
    if compressed.dtype != torch.float16:
        raise Mistake(f"{at}: compressed is {compressed.dtype}: cast it to the dtype asked for "
                      "(float16), that is what goes on the wire")
    if new_residual.dtype != grad.dtype:
        raise Mistake(f"{at}: the residual is {new_residual.dtype}: keep it in the gradient's "
                      f"dtype ({grad.dtype}); in float16 it would lose the very bits it keeps")
    if not torch.equal(compressed, want_c):
        if torch.equal(compressed, grad.to(torch.float16)):
            raise Mistake(f"{at}: compressed is the gradient alone: add the residual before the "
                          "cast; that is how what float16 lost last step reaches the wire")
        raise Mistake(f"{at}: compressed differs from (tensor + residual).to(float16) by up to "
                      f"{(compressed.float() - want_c.float()).abs().max():.3g}")
    if not torch.equal(new_residual, want_r):
        if torch.equal(new_residual, -want_r):
            raise Mistake(f"{at}: the residual has the wrong sign: it is what the cast lost, "
                          "(tensor + residual) - compressed")
        if torch.equal(new_residual, grad - compressed.float()):
            raise Mistake(f"{at}: the new residual forgets the old one: compute it from "
                          "tensor + residual, not from the tensor alone")
        raise Mistake(f"{at}: the residual differs from (tensor + residual) - compressed by up "
                      f"to {(new_residual - want_r).abs().max():.3g}")


EXERCISES = [
    Exercise("09.1", "fp16_compress_hook", check_fp16_hook, timeout_s=30.0,
             hang_hint="Does every rank call the all-reduce once per bucket?"),
    Exercise("09.2", "compress_with_error_feedback", check_error_feedback, world_sizes=(1,)),
]

"""Chapter 05: a DDP of your own, checked against native DDP; gradient accumulation with no_sync.

How the gradients are compared:

* at 2 ranks, bit for bit with native DDP.  Native multiplies each gradient by 1/N and then sums
  (reducer.cpp, Reducer::mark_variable_ready_dense: ``at::mul_out(bucket_view, grad, 1/N)``
  before the all-reduce); dividing the sum instead, (a + b) / 2, gives the same bits as
  a/2 + b/2, because halving is exact in binary floating point;
* at 3 ranks, dividing by 3 rounds, and the order of the sum is the learner's choice, so the
  learner's gradient is compared with the exact mean (float64) within what N - 1 additions and one
  division can round: (N + 1) · u · Σ|g_i| / N, u the unit roundoff of float32.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as NativeDDP

from .core import Context, Exercise
from .guard import Mistake

U32 = torch.finfo(torch.float32).eps / 2


def make_model() -> nn.Module:
    """Small, but with several layers, a LayerNorm and biases: buckets have something to split."""
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 32),
                         nn.Tanh(), nn.Linear(32, 4))


def batch(rank: int, step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)


def loss_of(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in
            model.named_parameters()}


def compare_grads(ctx: Context, mine: dict, native: dict, per_rank_local: list[dict],
                  when: str, scale: float = 1.0) -> None:
    """Raise a Mistake about the first parameter whose gradient is not native's."""
    world = ctx.world_size
    for name in native:
        if mine[name] is None:
            raise Mistake(f"{when}: rank {ctx.rank}, parameter '{name}' has no gradient (None)")
    if ctx.rank == 0:  # the figure, drawn whether this step passes or not
        diffs = {n: float((mine[n].double() - w.double()).abs().max()) for n, w in native.items()}
        ctx.feedback.update({"figure": "bars", "labels": list(diffs),
                             "values": [max(d, 1e-12) for d in diffs.values()],
                             "ylabel": f"max |yours - native| ({world} ranks)",
                             "title": f"gradient difference per parameter, {when}"})
    for name, want in native.items():
        got = mine[name]
        terms = torch.stack([g[name].double() for g in per_rank_local])
        exact = terms.sum(0) / world * scale
        if world == 2:
            ok = torch.equal(got, want)
        else:
            bound = (world + 1) * U32 * terms.abs().sum(0) / world * abs(scale) + 1e-30
            ok = bool(((got.double() - exact).abs() <= bound).all())
        if not ok:
            raise Mistake(_grad_message(ctx, name, got, want, terms, when, scale))


def _grad_message(ctx, name, got, want, terms, when, scale) -> str:
    world = ctx.world_size
    where = int((got != want).view(-1).nonzero()[0]) if (got != want).any() else 0
    head = (f"{when}: rank {ctx.rank}, parameter '{name}', element {where}: gradient "
            f"{got.view(-1)[where]:.6g}, native DDP's {want.view(-1)[where]:.6g}")
    total = terms.sum(0).float() * scale
    own = terms[ctx.rank].float() * scale
    if torch.allclose(got, total, rtol=1e-4, atol=1e-7) and world > 1:
        return f"{head}. Gradients are {world}× native's: did you divide by the world size?"
    if torch.allclose(got, own, rtol=1e-5, atol=1e-8):
        return (f"{head}. It is this rank's own gradient, never averaged: was it all-reduced "
                "by the time loss.backward() returned? (every parameter, the last bucket too)")
    if torch.allclose(got, want * 2, rtol=1e-4, atol=1e-7):
        return f"{head}. It is twice native's: was it all-reduced twice, or accumulated twice?"
    return f"{head}. Off by {(got - want).abs().max():.3g} at most."


def _replicas(ctx: Context, module: nn.Module) -> list[dict]:
    return ctx.gather({n: t.detach().clone() for n, t in module.state_dict().items()})


def check_ddp(ctx: Context) -> None:
    start = make_model()  # different on every rank: the framework seeds each rank differently
    rank0 = ctx.gather({n: t.clone() for n, t in start.state_dict().items()})[0]
    for cap in (25.0, 0.0005):  # one bucket, then a bucket per parameter or so
        model = copy.deepcopy(start)
        ddp = ctx.call(ctx.learner.DDP, model, bucket_cap_mb=cap)
        if getattr(ddp, "module", None) is not model:
            raise Mistake("ddp.module must be the module you wrapped (the same object)")
        _check_replicas(ctx, ddp.module, rank0)
        native_model = make_model()  # a fresh copy: no hook of the learner's comes along
        native_model.load_state_dict(ddp.module.state_dict())
        native = NativeDDP(native_model, bucket_cap_mb=cap)
        x, y = batch(ctx.rank, 0)
        out = ctx.call(ddp, x)
        if not torch.equal(out, native_model(x)):
            raise Mistake("ddp(x) must return what the wrapped module returns for x")
        for step in range(2):  # the second step checks that the hooks still work after step 1
            x, y = batch(ctx.rank, step)
            ctx.call(lambda ddp=ddp, x=x, y=y: loss_of(ddp, x, y).backward())
            loss_of(native, x, y).backward()
            compare_grads(ctx, local_grads(model), local_grads(native_model),
                          _local_reference(ctx, ddp.module, step), f"step {step + 1} "
                          f"(bucket_cap_mb={cap})")
            for m in (model, native_model):
                with torch.no_grad():
                    for p in m.parameters():
                        p -= 0.1 * p.grad
                        p.grad = None
        _check_no_sync(ctx, ddp, native, model, native_model)


def _local_reference(ctx, module, step) -> list[dict]:
    """Every rank's own (unsynchronised) gradient for this step: a plain copy, no DDP at all."""
    twin = copy.deepcopy(module)
    for p in twin.parameters():
        p.grad = None
    x, y = batch(ctx.rank, step)
    loss_of(twin, x, y).backward()
    return ctx.gather(local_grads(twin))


def _check_replicas(ctx: Context, module: nn.Module, rank0: dict) -> None:
    everyone = _replicas(ctx, module)
    for name, want in rank0.items():
        for r, state in enumerate(everyone):
            if not torch.equal(state[name], want):
                same = all(torch.equal(s[name], everyone[0][name]) for s in everyone)
                why = ("the replicas are equal, but not rank 0's weights: broadcast from rank 0, "
                       "as native DDP does" if same else
                       "make the replicas equal when DDP is constructed (broadcast rank 0's "
                       "parameters and buffers): the ranks start from different random weights")
                off = (state[name] - want).abs().max()
                raise Mistake(f"after DDP(model), rank {r}'s '{name}' differs from rank 0's "
                              f"starting weights by up to {off:.3g}: {why}")


def _check_no_sync(ctx, ddp, native, model, native_model) -> None:
    with torch.no_grad():  # the same weights on both sides again (3 ranks: they drift by ulps)
        native_model.load_state_dict(model.state_dict())
    x, y = batch(ctx.rank, 5)
    with ctx.call(ddp.no_sync):
        ctx.call(lambda: loss_of(ddp, x, y).backward())
    own = local_grads(model)
    with native.no_sync():
        loss_of(native, x, y).backward()
    for name, g in local_grads(native_model).items():
        if not torch.equal(own[name], g):
            raise Mistake(f"inside `with ddp.no_sync():` rank {ctx.rank}'s gradient of '{name}' "
                          "is not its own local gradient: no_sync must skip the communication "
                          "(the gradients were averaged anyway)")
    x, y = batch(ctx.rank, 6)
    ctx.call(lambda: loss_of(ddp, x, y).backward())
    loss_of(native, x, y).backward()
    mine, theirs = local_grads(model), local_grads(native_model)
    for name, want in theirs.items():
        close = torch.allclose(mine[name], want, rtol=1e-5, atol=1e-6)
        if not (torch.equal(mine[name], want) if ctx.world_size == 2 else close):
            raise Mistake(f"the first backward after no_sync: rank {ctx.rank}, '{name}': "
                          f"{(mine[name] - want).abs().max():.3g} from native DDP, which averages "
                          "the gradients accumulated inside no_sync together with this one: "
                          "does your no_sync turn communication back on when it exits?")


# ---------------------------------------------------------------- 05.2 gradient accumulation
def check_accumulate(ctx: Context) -> None:
    torch.manual_seed(7)  # the same start on every rank, so native DDP needs no broadcast
    model = make_model()
    full_model = copy.deepcopy(model).double()
    native = NativeDDP(model, bucket_cap_mb=0.0005)
    losses, synced = [0], set()  # which micro-batch's backward (by loss_fn call) communicated

    def counting_hook(state, bucket):
        synced.add(losses[0])
        return _allreduce_mean(bucket)

    def counting_loss(*args, **kwargs):
        losses[0] += 1
        return nn.functional.mse_loss(*args, **kwargs)

    native.register_comm_hook(None, counting_hook)
    micro = [batch(ctx.rank, 10 + k, n=4) for k in range(4)]
    ctx.call(ctx.learner.accumulate_gradients, native, micro, counting_loss)
    # The exact answer, in float64: one backward of the whole batch (all ranks' micro-batches).
    all_micro = ctx.gather(micro)
    xs = torch.cat([x for rank_micro in all_micro for x, _ in rank_micro]).double()
    ys = torch.cat([y for rank_micro in all_micro for _, y in rank_micro]).double()
    nn.functional.mse_loss(full_model(xs), ys).backward()
    k = len(micro)
    for (name, p), q in zip(model.named_parameters(), full_model.parameters(), strict=True):
        got, want = p.grad.double(), q.grad
        tol = 1e-4 * want.abs().max() + 1e-7  # float32 backward vs float64: a few ulp per op
        if not bool(((got - want).abs() <= tol).all()):
            if torch.allclose(got, want * k, rtol=1e-3, atol=1e-6):
                cause = (f"they are {k}× the whole batch's: divide each micro-batch's loss by the "
                         f"number of micro-batches ({k})")
            else:
                cause = ("does the last micro-batch run outside no_sync (so the accumulated "
                         "gradients get averaged across the ranks)?")
            raise Mistake(f"rank {ctx.rank}, '{name}': accumulated gradient off by "
                          f"{(got - want).abs().max():.3g} from one backward of the whole batch: "
                          f"{cause}")
    if len(synced) > 1:
        raise Mistake(f"your loop communicated on {len(synced)} of {k} micro-batches: wrap all but "
                      "the last backward in `with ddp.no_sync():` (the sum is the same, the "
                      "traffic is 1/k of it)")


def _allreduce_mean(bucket):
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])


EXERCISES = [
    Exercise("05.1", "DDP", check_ddp, timeout_s=40.0),
    Exercise("05.2", "accumulate_gradients", check_accumulate),
]

"""Rank functions for the NaiveDDP / BucketedDDP tests (importable, as mp.spawn requires).

Each function runs a batch of checks on every rank and returns rank 0's findings, so that one
launch (a few seconds of process start-up) serves many assertions.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as NativeDDP
from torch.utils.checkpoint import checkpoint

from ddplab import BucketedDDP, NaiveDDP
from ddplab.timeline import Timeline


def mlp(frozen_first: bool = False, batchnorm: bool = False) -> nn.Module:
    layers = [nn.Linear(8, 16)] + ([nn.BatchNorm1d(16)] if batchnorm else [])
    layers += [nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)]
    model = nn.Sequential(*layers)
    if frozen_first:
        model[0].requires_grad_(False)
    return model


class Tied(nn.Module):
    """One layer used twice in forward: its gradient has two contributions, one hook call."""

    def __init__(self):
        super().__init__()
        self.shared, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.shared(torch.relu(self.shared(x)))))


class CheckpointedTwice(nn.Module):
    """``shared`` used outside and inside a reentrant checkpoint: two accumulations per pass."""

    def __init__(self):
        super().__init__()
        self.shared, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = self.shared(x)
        return self.head(checkpoint(lambda t: torch.relu(self.shared(t)), h, use_reentrant=True))


class TwoHeads(nn.Module):
    """``unused`` takes no part in the loss: its gradient never arrives (on ``unused_on`` ranks)."""

    def __init__(self, unused_on: set[int]):
        super().__init__()
        self.body, self.head, self.unused = nn.Linear(8, 8), nn.Linear(8, 3), nn.Linear(8, 3)
        self.skip = dist.get_rank() in unused_on

    def forward(self, x):
        h = self.body(x)
        return self.head(h) if self.skip else self.head(h) + 0 * self.unused(h)


def batches(rank: int, steps: int, size: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Different data on every rank, the same on every run."""
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(size, 8, generator=g), torch.randint(0, 3, (size,), generator=g))
            for _ in range(steps)]


def train(wrapped: nn.Module, data, accumulate: int = 1) -> nn.Module:
    """SGD with momentum; ``accumulate`` > 1 splits each batch into micro-batches (no_sync)."""
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        for i, (xm, ym) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate), strict=True)):
            last = i == accumulate - 1
            context = wrapped.no_sync() if not last else _nothing()
            with context:
                loss = nn.functional.cross_entropy(wrapped(xm), ym) / accumulate
                loss.backward()
            if isinstance(wrapped, NaiveDDP) and last:
                wrapped.sync_gradients()
        opt.step()
        opt.zero_grad()
    return wrapped.module


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def max_diff(a: nn.Module, b: nn.Module, what: str = "state") -> float:
    """Largest |a - b| over parameters and buffers (``state``) or over gradients."""
    if what == "grad":
        pairs = [(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True)]
        if any((x is None) != (y is None) for x, y in pairs):
            return float("inf")
        pairs = [(x, y) for x, y in pairs if x is not None]
    else:
        pairs = list(zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    return max(((x.double() - y.double()).abs().max().item() for x, y in pairs), default=0.0)


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def against_native(make_model, wrap, steps: int = 3, accumulate: int = 1,
                   native_kwargs: dict | None = None, evaluate: bool = False) -> float:
    """Train ``wrap(model)`` and native DDP from the same start on the same data: max |Δ|
    of parameters and buffers on every rank (and, with ``evaluate``, of an eval-mode output
    under no_grad after training, which BatchNorm computes from its running statistics)."""
    torch.manual_seed(0)
    model = make_model()
    data = batches(dist.get_rank(), steps)
    wrapped = [wrap(copy.deepcopy(model)),
               NativeDDP(copy.deepcopy(model), **(native_kwargs or {}))]
    ours, native = (train(w, data, accumulate) for w in wrapped)
    worst = max_diff(ours, native)
    if evaluate:
        outputs = []
        for w in wrapped:
            w.eval()
            with torch.no_grad():
                outputs.append(w(data[0][0]))
        worst = max(worst, (outputs[0] - outputs[1]).abs().max().item())
    return max_over_ranks(worst)


def catch(fn) -> dict:
    start = time.perf_counter()
    try:
        fn()
    except Exception as err:  # the tests inspect type and message
        return {"type": type(err).__name__, "message": str(err),
                "seconds": time.perf_counter() - start}
    return {"type": None, "message": "", "seconds": time.perf_counter() - start}


# --- NaiveDDP -----------------------------------------------------------------------------------

def naive_checks(ctx, args) -> dict:
    world = ctx.world_size
    results = {"vs_native": against_native(mlp, NaiveDDP),
               "vs_native_no_sync": against_native(mlp, NaiveDDP, accumulate=2),
               "vs_native_frozen": against_native(lambda: mlp(frozen_first=True), NaiveDDP)}

    torch.manual_seed(ctx.rank)  # a different model on every rank
    results["seed_mismatch"] = catch(lambda: NaiveDDP(mlp()))

    torch.manual_seed(0)
    wrapped = NaiveDDP(mlp())
    x, y = batches(ctx.rank, 1)[0]
    with wrapped.no_sync():
        nn.functional.cross_entropy(wrapped(x), y).backward()
        local = [p.grad.clone() for p in wrapped.parameters()]
        wrapped.sync_gradients()  # a no-op inside no_sync
    results["no_sync_keeps_local_grads"] = all(
        torch.equal(a, p.grad) for a, p in zip(local, wrapped.parameters(), strict=True))
    results["sync_after_no_sync"] = wrapped.do_sync
    wrapped.sync_gradients()
    mean = [g.clone() for g in local]
    for g in mean:
        dist.all_reduce(g)
        g /= world
    results["sync_averages"] = max_over_ranks(max(
        (a - p.grad).abs().max().item() for a, p in zip(mean, wrapped.parameters(), strict=True)))
    wrapped.eval()
    results["eval_reaches_module"] = not wrapped.module.training
    results["forward_delegates"] = torch.equal(wrapped(x), wrapped.module(x))
    return results if ctx.is_main else None


# --- BucketedDDP --------------------------------------------------------------------------------

def bucketed_checks(ctx, args) -> dict:
    results = {
        "vs_native": against_native(mlp, BucketedDDP),
        "vs_native_no_overlap": against_native(mlp, lambda m: BucketedDDP(m, overlap=False)),
        "vs_native_tiny_buckets": against_native(mlp, lambda m: BucketedDDP(m, 1e-9)),
        "vs_native_one_bucket": against_native(mlp, lambda m: BucketedDDP(m, 1e6)),
        "vs_native_frozen": against_native(lambda: mlp(frozen_first=True), BucketedDDP),
        "vs_native_batchnorm": against_native(lambda: mlp(batchnorm=True), BucketedDDP,
                                              evaluate=True),
        "vs_native_batchnorm_no_sync": against_native(lambda: mlp(batchnorm=True), BucketedDDP,
                                                      accumulate=3, evaluate=True),
        "vs_native_no_sync": against_native(mlp, BucketedDDP, accumulate=3),
        "vs_native_used_twice": against_native(Tied, lambda m: BucketedDDP(m, 1e-9)),
    }
    torch.manual_seed(0)
    results["buckets"] = {
        "tiny": [b.names for b in BucketedDDP(mlp(), 1e-9).buckets],
        "one": [b.names for b in BucketedDDP(mlp(), 1e6).buckets],
        "frozen": [b.names for b in BucketedDDP(mlp(frozen_first=True)).buckets],
    }

    torch.manual_seed(ctx.rank)  # a different model on every rank: BucketedDDP copies rank 0's
    wrapped = BucketedDDP(mlp(batchnorm=True))
    results["replicas_equal_after_wrap"] = _differs_from_rank0(wrapped.module) == 0.0

    timeline = Timeline(ctx.rank)
    timed = BucketedDDP(mlp(), 1e-4, timeline=timeline)
    x, y = batches(ctx.rank, 1)[0]
    timeline.start_clock()
    nn.functional.cross_entropy(timed(x), y).backward()
    results["timeline"] = [(e.name, e.cat, e.start_ms, e.end_ms, e.args) for e in timeline.events]
    results["bucket_bytes"] = [b.nbytes for b in timed.buckets]

    torch.manual_seed(0)
    unused = BucketedDDP(TwoHeads(unused_on=set(range(ctx.world_size))))
    results["unused"] = catch(lambda: unused(x).sum().backward())
    results["unused_then_works"] = catch(lambda: _fine_step(BucketedDDP(mlp()), x))
    twice = BucketedDDP(CheckpointedTwice())
    results["gradient_twice"] = catch(lambda: twice(x).sum().backward())
    results["second_backward"] = _second_backward_stays_local(BucketedDDP(mlp()), x)
    return results if ctx.is_main else None


def _fine_step(wrapped, x):
    wrapped(x).sum().backward()


def _second_backward_stays_local(wrapped, x) -> dict:
    """One forward averages one backward (native's rule): a second backward of the same graph
    adds this rank's own gradient, uncommunicated, so the ranks' gradients then differ."""
    loss = wrapped(x).sum()
    loss.backward(retain_graph=True)
    after_first = _grads_differ_from_rank0(wrapped.module)
    loss.backward()
    return {"after_first": after_first, "after_second": _grads_differ_from_rank0(wrapped.module)}


def _grads_differ_from_rank0(module: nn.Module) -> float:
    worst = 0.0
    for p in module.parameters():
        rank0s = p.grad.clone()
        dist.broadcast(rank0s, src=0)
        worst = max(worst, (p.grad - rank0s).abs().max().item())
    return max_over_ranks(worst)


def _differs_from_rank0(module: nn.Module) -> float:
    worst = 0.0
    for t in module.state_dict().values():
        rank0s = t.clone()
        dist.broadcast(rank0s, src=0)
        worst = max(worst, (t.double() - rank0s.double()).abs().max().item())
    return max_over_ranks(worst)


def equivalence_only(ctx, args) -> dict:
    """For other world sizes: both wrappers against native, plain and with accumulation."""
    results = {"naive": against_native(mlp, NaiveDDP),
               "bucketed": against_native(mlp, BucketedDDP),
               "bucketed_tiny_buckets": against_native(mlp, lambda m: BucketedDDP(m, 1e-9)),
               "bucketed_no_sync": against_native(mlp, BucketedDDP, accumulate=2)}
    return results if ctx.is_main else None


def unused_on_rank0_only(ctx, args) -> None:
    """Rank 0 skips a parameter, rank 1 does not: rank 0 raises, rank 1 must not hang."""
    torch.manual_seed(0)
    wrapped = BucketedDDP(TwoHeads(unused_on={0}))
    x, _ = batches(ctx.rank, 1)[0]
    wrapped(x).sum().backward()

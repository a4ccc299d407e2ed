"""Rank functions for the NaiveDDP / BucketedDDP tests (importable, as mp.spawn requires).

Each function runs a batch of checks on every rank and returns rank 0's findings, so that one
launch (a few seconds of process start-up) serves many assertions.
"""

from __future__ import annotations

import copy
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as NativeDDP
from torch.utils.checkpoint import checkpoint

from ddplab import BucketedDDP, NaiveDDP
from ddplab.bucketed_ddp import assign_buckets, native_buffer_sync
from ddplab.run.ranks import max_over_ranks
from ddplab.run.timeline import Timeline


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


class Wide(nn.Sequential):
    """Over 2 MiB of gradients: native's default layout (1 MiB first bucket, then 25 MiB) shows."""

    def __init__(self):
        super().__init__(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 1024), nn.ReLU(),
                         nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 3))


class Mixed(nn.Module):
    """A float64 layer between float32 ones: buckets hold one dtype, one open bucket per dtype."""

    def __init__(self):
        super().__init__()
        self.first, self.middle, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.middle.double()

    def forward(self, x):
        h = torch.relu(self.first(x))
        return self.head(torch.relu(self.middle(h.double())).float())


def train_pair(make_model, wrap_ours, native_kwargs: dict, steps: int = 4, accumulate: int = 1):
    """Ours and native DDP from the same start, trained on the same data: (ours, native),
    plus both bucket layouts before the first step."""
    torch.manual_seed(0)
    model = make_model()
    data = batches(dist.get_rank(), steps)
    ours, native = wrap_ours(copy.deepcopy(model)), NativeDDP(copy.deepcopy(model),
                                                              **native_kwargs)
    layouts = {"first": (layout_of(ours), native_layout(native))}
    for wrapped in (ours, native):
        train(wrapped, data, accumulate)
    layouts["rebuilt"] = (layout_of(ours), native_layout(native))
    return ours, native, data, layouts


def against_native(make_model, wrap, steps: int = 4, accumulate: int = 1,
                   native_kwargs: dict | None = None, evaluate: bool = False) -> float:
    """Train ``wrap(model)`` and native DDP from the same start on the same data: max |Δ|
    of parameters and buffers on every rank (and, with ``evaluate``, of an eval-mode output
    under no_grad after training, which BatchNorm computes from its running statistics)."""
    ours, native, data, _ = train_pair(make_model, wrap, native_kwargs or {}, steps, accumulate)
    return max_over_ranks(worst_difference(ours, native, data, evaluate))


def worst_difference(ours, native, data, evaluate: bool) -> float:
    """Max |Δ| of parameters and buffers on this rank; with ``evaluate``, of an eval-mode
    output under no_grad too (BatchNorm computes it from its running statistics)."""
    worst = max_diff(ours.module, native.module)
    if evaluate:
        outputs = []
        for w in (ours, native):
            w.eval()
            with torch.no_grad():
                outputs.append(w(data[0][0]))
        worst = max(worst, (outputs[0] - outputs[1]).abs().max().item())
    return worst


def layout_of(wrapped) -> list[list[str]] | None:
    return [list(b.names) for b in wrapped.buckets] if isinstance(wrapped, BucketedDDP) else None


def native_layout(ddp: NativeDDP) -> list[list[str]]:
    """Native DDP's buckets, parameter names in bucket order (a private API, fine in a test)."""
    names = {p: n for n, p in ddp.module.named_parameters()}
    return [[names[p] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]


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


# --- BucketedDDP ----------------------------------------------------------------------------------

# Every case compares BucketedDDP with native DDP at its defaults — gradient_as_bucket_view=False,
# no comm hook, find_unused_parameters=False, forward_sync_buffers=True — and the same
# bucket_cap_mb (None: native's default, 1 MiB first bucket then 25 MiB).  Those settings make
# native multiply each gradient by 1/N while copying it into its bucket, as BucketedDDP does.
# name: (model, bucket_cap_mb, micro-batches, evaluate after training, extra BucketedDDP kwargs)
BITWISE_CASES = {
    "default_cap": (mlp, None, 1, False, {}),
    "wide_default_cap": (Wide, None, 1, False, {}),
    "wide_cap_1_mib": (Wide, 1.0, 1, False, {}),
    "tiny_buckets_0.001_mib": (mlp, 0.001, 1, False, {}),
    "one_parameter_per_bucket": (mlp, 1e-9, 1, False, {}),
    "huge_buckets": (mlp, 1e6, 1, False, {}),
    "frozen_first_layer": (lambda: mlp(frozen_first=True), 0.001, 1, False, {}),
    "tied_weights": (Tied, 0.001, 1, False, {}),
    "batchnorm": (lambda: mlp(batchnorm=True), None, 1, True, {}),
    "batchnorm_no_sync": (lambda: mlp(batchnorm=True), 0.001, 3, True, {}),
    "batchnorm_forward_sync_off": (lambda: mlp(batchnorm=True), None, 1, True,
                                   {"forward_sync_buffers": False}),
    "no_sync": (mlp, None, 3, False, {}),
    "no_sync_tiny_buckets": (mlp, 0.001, 2, False, {}),
    "no_overlap": (mlp, 0.001, 1, False, {"overlap": False}),
    "mixed_dtypes": (Mixed, None, 1, False, {}),
    "mixed_dtypes_tiny_buckets": (Mixed, 0.001, 1, False, {}),
}


class ReverseOrderLayout(BucketedDDP):
    """Buckets in reverse definition order from the start, never rebuilt."""

    def __init__(self, module: nn.Module):
        super().__init__(module, 0.001)
        self.use_layout(assign_buckets(self.params, self.caps[1]), keep=True)


def bitwise_cases(ctx, args) -> dict:
    """Every case of BITWISE_CASES: max |Δ| of parameters and buffers against native DDP (and of
    an eval-mode output), and whether the bucket layouts agree (first iteration, rebuilt)."""
    results = {}
    for name, (make_model, cap, micro, evaluate, extra) in BITWISE_CASES.items():
        native_kwargs = {"bucket_cap_mb": cap}
        if "forward_sync_buffers" in extra:
            native_kwargs.update(native_buffer_sync(extra["forward_sync_buffers"]))
        ours, native, data, layouts = train_pair(
            make_model, lambda m, cap=cap, extra=extra: BucketedDDP(m, cap, **extra),
            native_kwargs, accumulate=micro)
        results[name] = {
            "max_diff": max_over_ranks(worst_difference(ours, native, data, evaluate)),
            "layouts": {when: {"ours": a, "native": b} for when, (a, b) in layouts.items()},
            "layouts_differ_on_some_rank": max_over_ranks(float(any(
                a != b for a, b in layouts.values()))),
        }
    # The control: the right sums in the wrong places.  Reverse definition order, never
    # rebuilt (BucketedDDP's layout before it copied native's): from 3 ranks on, some bits differ.
    results["control_reverse_order_layout"] = {
        "max_diff": against_native(mlp, ReverseOrderLayout, native_kwargs={"bucket_cap_mb": 0.001})}
    # NaiveDDP: one message per parameter, divided after the sum (see test_naive_ddp.py).
    results["naive"] = {"max_diff": against_native(mlp, NaiveDDP)}
    results["naive_no_sync"] = {"max_diff": against_native(mlp, NaiveDDP, accumulate=2)}
    return results if ctx.is_main else None


def bucketed_checks(ctx, args) -> dict:
    """BucketedDDP's behaviour beyond the numbers: start, timeline, errors (2 ranks)."""
    results = {}
    torch.manual_seed(ctx.rank)  # a different model on every rank: BucketedDDP copies rank 0's
    wrapped = BucketedDDP(mlp(batchnorm=True))
    results["replicas_equal_after_wrap"] = _differs_from_rank0(wrapped.module) == 0.0
    model = mlp(batchnorm=True)
    model[1].running_mean.fill_(ctx.rank)  # rank-local statistics: copied from rank 0 anyway
    wrapped = BucketedDDP(model, forward_sync_buffers=False)  # (as native DDP's flag does)
    results["buffers_synced_at_construction_without_forward_sync"] = (
        _differs_from_rank0(wrapped.module) == 0.0)
    with warnings.catch_warnings(record=True) as caught:  # the current keyword: no warning
        warnings.simplefilter("always")
        NativeDDP(mlp(batchnorm=True), **native_buffer_sync(False))
    results["native_buffer_sync_warnings"] = [str(w.message) for w in caught
                                              if issubclass(w.category, FutureWarning)]

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


def unused_on_rank0_only(ctx, args) -> None:
    """Rank 0 skips a parameter, rank 1 does not: rank 0 raises, rank 1 must not hang."""
    torch.manual_seed(0)
    wrapped = BucketedDDP(TwoHeads(unused_on={0}))
    x, _ = batches(ctx.rank, 1)[0]
    wrapped(x).sum().backward()

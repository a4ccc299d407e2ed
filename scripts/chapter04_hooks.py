"""Chapter 04 — autograd hooks, the order gradients become ready, buckets, and overlap.

Where does DDP get the chance to communicate *during* backward?  From autograd hooks.  The
script tours the hooks PyTorch offers (tensor, post-accumulate-grad and module hooks) and the
trap in one of them; measures when each parameter's gradient becomes ready in the book's model;
draws BucketedDDP's all-reduces against the backward pass with and without overlap; and sweeps
the bucket size for BucketedDDP and native DDP.

Run it:
    make run-chapter04                            # runs the next line
    python scripts/chapter04_hooks.py             # 2 CPU ranks, or one rank per GPU
    python scripts/chapter04_hooks.py --quick     # under a minute on a 2-core laptop
    torchrun --standalone --nproc-per-node 2 scripts/chapter04_hooks.py
    python scripts/chapter04_hooks.py --replot    # only redraw the figures

Writes out/chapter04/{hooks.png, ready_order.png, overlap.png, bucket_sweep.png,
overlap_trace.json, results.json} (or under --out DIR); the figures are drawn from results.json
alone (scripts/drawing/chapter04.py).  overlap_trace.json opens in https://ui.perfetto.dev or
chrome://tracing.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddplab
import drawing.chapter04
from backstage.chapter04 import sweep_reading, sweep_verdict
from ddplab import BucketedDDP
from ddplab.bucketed_ddp import MiB, assign_buckets
from ddplab.run import timing
from ddplab.run.chapter_main import run_chapter
from ddplab.run.models import ResidualMLP, make_clusters, sgd
from ddplab.run.ranks import native_ddp
from ddplab.run.timeline import Event, Timeline, gather_events, write_chrome_trace

CHAPTER = 4
BATCH = 128  # samples per rank per step
LR, MOMENTUM = 0.05, 0.9
SWEEP_CAPS_MB = (0.25, 0.5, 1, 2, 4, 8, 16, 32, 100)
QUICK_SWEEP_CAPS_MB = (0.25, 1, 4, 32)


# --- 1. a tour of the hooks ------------------------------------------------------------------

def hook_tour() -> list[dict]:
    """Every kind of hook on a two-layer model, and the order in which they fire."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    events: list[dict] = []

    def log(kind: str, where: str) -> None:
        events.append({"kind": kind, "where": where})

    # --8<-- [start:tour]
    for name, layer in (("layer 0", model[0]), ("layer 2", model[2])):
        layer.register_forward_pre_hook(lambda m, args, name=name: log("forward pre-hook", name))
        layer.register_forward_hook(lambda m, args, out, name=name: log("forward hook", name))
        layer.register_full_backward_hook(
            lambda m, grad_in, grad_out, name=name: log("full backward hook", name))

    def hook_the_activation(module, args, out) -> None:  # returning a value would replace out
        out.register_hook(lambda grad: log("tensor hook", "ReLU output"))  # receives the grad

    model[1].register_forward_hook(hook_the_activation)

    names = {p: n for n, p in model.named_parameters()}
    queued = False

    def on_accumulated(param: torch.Tensor) -> None:  # receives the parameter; use param.grad
        nonlocal queued
        log("post-accumulate-grad hook", names[param])
        if not queued:  # once per backward: ask the engine to call us when backward is done
            queued = True
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: log("queued callback", "autograd engine"))

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(on_accumulated)
    # --8<-- [end:tour]

    x = torch.randn(5, 3, requires_grad=True)  # so that layer 0 has an input gradient to report
    loss = model(x).square().mean()
    log("backward starts", "loss.backward()")
    loss.backward()
    log("backward returned", "loss.backward()")
    return events


# --8<-- [start:trap]
def post_accumulate_trap() -> dict:
    """A hook written as if it received the gradient halves the *parameter* instead.

    ``register_hook`` hands its hook the gradient; ``register_post_accumulate_grad_hook``
    hands it the parameter (pytorch/pytorch#187268).  Hooks run with gradient recording off,
    so the in-place change to a leaf that requires grad raises no error: it just happens.
    """
    weight = nn.Parameter(torch.ones(3))
    received = []

    def scale_gradient(grad):  # the intent: halve the gradient
        received.append(grad)
        grad.mul_(0.5)

    weight.register_post_accumulate_grad_hook(scale_gradient)
    (weight * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    return {"hook_received_the_parameter": received[0] is weight,
            "parameter_after": weight.detach().tolist(),   # halved: silently corrupted
            "gradient_after": weight.grad.tolist()}       # untouched: [1, 2, 3]
# --8<-- [end:trap]


# --- 2. when does each gradient become ready? ------------------------------------------------

def book_model(ctx: ddplab.RankContext) -> nn.Module:
    torch.manual_seed(ctx.seed)
    return ResidualMLP().to(ctx.device)


def rank_batches(ctx: ddplab.RankContext, count: int) -> list[tuple[torch.Tensor, ...]]:
    x, y = make_clusters(BATCH * ctx.world_size * count, seed=5)
    x, y = x.to(ctx.device), y.to(ctx.device)
    mine = slice(ctx.rank, None, ctx.world_size)  # every rank a different share of the samples
    return list(zip(x[mine].split(BATCH), y[mine].split(BATCH), strict=True))


# --8<-- [start:ready]
def gradient_ready_times(model: nn.Module, batches, device: torch.device) -> dict[str, float]:
    """When each parameter's gradient is ready, in ms after ``loss.backward()`` started
    (median over the batches)."""
    names = {p: n for n, p in model.named_parameters()}
    ready: dict[str, list[float]] = {n: [] for n in names.values()}
    start = [0.0]

    def stamp(param):
        timing.synchronize(device)  # on a GPU: when the gradient exists, not when it was queued
        ready[names[param]].append((time.perf_counter() - start[0]) * 1e3)

    handles = [p.register_post_accumulate_grad_hook(stamp) for p in model.parameters()]
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        timing.synchronize(device)
        start[0] = time.perf_counter()
        loss.backward()
        model.zero_grad(set_to_none=True)
    for handle in handles:
        handle.remove()
    return {name: statistics.median(times[1:]) for name, times in ready.items()}  # [0]: warm-up
# --8<-- [end:ready]


def ready_order(ctx, args) -> dict:
    model = book_model(ctx)
    times = gradient_ready_times(model, rank_batches(ctx, 6 if ctx.quick else 21), ctx.device)
    named = list(model.named_parameters())
    buckets = assign_buckets(named, int(args.bucket_cap_mb * MiB))
    bucket_of = {name: i for i, group in enumerate(buckets) for name, _ in group}
    order = sorted(times, key=times.get)
    forward_index = {name: i for i, (name, _) in enumerate(named)}
    return {
        "parameters": [{"name": n, "numel": p.numel(), "ready_ms": times[n],
                        "bucket": bucket_of[n]} for n, p in named],
        "ready_order": order,
        # Spearman correlation between position in the model and position in the ready order:
        # -1 means exactly reversed.
        "rank_correlation_with_forward_order": spearman(
            [forward_index[n] for n in order], list(range(len(order)))),
        "bucket_cap_mb": args.bucket_cap_mb,
        "bucket_count": len(buckets),
        "buckets": [[n for n, _ in group] for group in buckets],
    }


def spearman(a: list[int], b: list[int]) -> float:
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) / (n * (n * n - 1))


# --- 3. communication against computation: a timeline ----------------------------------------

def timed_step(ddp: BucketedDDP, optimizer, x, y, timeline: Timeline) -> None:
    """One training step, with its phases on the timeline.  BucketedDDP itself adds a ``comm``
    span per bucket and a ``wait`` span for the end of backward."""
    with timeline.span("forward", "forward"):
        loss = F.cross_entropy(ddp(x), y)
    started = timeline.now()
    loss.backward()
    waits = [e for e in timeline.events if e.cat == "wait" and e.start_ms >= started]
    computed_until = waits[0].start_ms if waits else timeline.now()
    timeline.add("backward", "backward", started, computed_until)
    with timeline.span("optimizer", "optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def median_step_timeline(ctx, ddp: BucketedDDP, timeline: Timeline, batches,
                         steps: int) -> list[Event] | None:
    """Record ``steps`` steps; return (on rank 0) every rank's events of the median step."""
    optimizer = sgd(ddp, LR, MOMENTUM)
    recorded = []
    for i in range(steps + 2):  # the first two: warm-up
        timing.synchronize(ctx.device)
        dist.barrier()
        timeline.start_clock()
        x, y = batches[i % len(batches)]
        timed_step(ddp, optimizer, x, y, timeline)
        timing.synchronize(ctx.device)
        if i >= 2:
            recorded.append(list(timeline.events))
    if ctx.device.type == "cuda":  # host timestamps would time launches: read the GPU's clock
        x, y = batches[0]
        return gpu_kernel_events(ctx, lambda: timed_step(ddp, optimizer, x, y, timeline))
    lengths = timing.slowest_rank_per_step({"step": [max(e.end_ms for e in r) for r in recorded]})
    median = sorted(range(steps), key=lambda i: lengths["step"][i])[steps // 2]
    timeline.events = recorded[median]
    return gather_events(timeline)


def gpu_kernel_events(ctx, step) -> list[Event] | None:
    """One step on the GPU's clock: every kernel torch.profiler (CUPTI) saw, NCCL's as ``comm``,
    the rest as ``compute``; rank 0 gets every rank's.  On nccl a Work's future completes when
    the all-reduce is enqueued and ``wait()`` only makes the current stream wait, so the host
    clock BucketedDDP records would show launches, not transfers."""
    from torch.profiler import ProfilerActivity, profile

    timing.synchronize(ctx.device)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        timing.synchronize(ctx.device)
    kernels = [(e.name, e.time_range.start / 1e3, e.time_range.end / 1e3) for e in prof.events()
               if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    firsts = [None] * ctx.world_size  # one machine: the ranks' profiler clocks are the host's
    dist.all_gather_object(firsts, min((k[1] for k in kernels), default=float("inf")))
    origin = min(firsts)
    timeline = Timeline(ctx.rank)
    for name, start, end in kernels:
        comm = "nccl" in name.lower()
        timeline.add("NCCL kernel" if comm else "kernel", "comm" if comm else "compute",
                     start - origin, end - origin, clock="cuda (torch.profiler)", kernel=name)
    return gather_events(timeline)


def overlap_study(ctx, args) -> dict:
    model = book_model(ctx)
    batches = rank_batches(ctx, 4)
    steps = 5 if ctx.quick else 15
    result = {"timelines": {}, "bucket_cap_mb": args.bucket_cap_mb}
    for overlap in (True, False):
        timeline = Timeline(ctx.rank)
        ddp = BucketedDDP(copy.deepcopy(model), args.bucket_cap_mb, timeline=timeline,
                          overlap=overlap)
        events = median_step_timeline(ctx, ddp, timeline, batches, steps)
        key = "overlap" if overlap else "no_overlap"
        result["timelines"][key] = [vars(e) for e in events] if events is not None else None
        result.setdefault("phases_ms", {})[key] = phase_durations(events)

    variants = {
        "overlap": BucketedDDP(copy.deepcopy(model), args.bucket_cap_mb),
        "no_overlap": BucketedDDP(copy.deepcopy(model), args.bucket_cap_mb, overlap=False),
        "native": native_ddp(copy.deepcopy(model), ctx, bucket_cap_mb=args.bucket_cap_mb),
    }
    result["step_time_ms"] = ms = median_step_times(ctx, variants, batches,
                                                    rounds=8 if ctx.quick else 40,
                                                    desc="timing overlap vs no overlap")
    result["no_overlap_vs_overlap"] = ms["no_overlap"] / ms["overlap"]
    return result


def phase_durations(events: list[Event] | None) -> dict[str, dict[str, float]] | None:
    """Each rank's time in each phase of the drawn step (ms), as {"rank0": {...}, ...}; comm is
    from the first launch to the last completion.  (On a GPU the phases are kernel times.)"""
    if events is None:
        return None
    result = {}
    for rank in sorted({e.rank for e in events}):
        mine = [e for e in events if e.rank == rank]
        phases = {cat: sum(e.duration_ms for e in mine if e.cat == cat)
                  for cat in sorted({e.cat for e in mine} - {"comm"})}
        comm = [e for e in mine if e.cat == "comm"]
        phases["comm"] = max(e.end_ms for e in comm) - min(e.start_ms for e in comm)
        result[f"rank{rank}"] = phases
    return result


def median_step_times(ctx, variants: dict[str, nn.Module], batches, rounds: int,
                      desc: str) -> dict[str, float]:
    """Median step time (ms, slowest rank) of each wrapped model, interleaved and shuffled."""
    steps = {}
    for name, ddp in variants.items():
        optimizer, counter = sgd(ddp, LR, MOMENTUM), iter(range(10**9))

        def step(ddp=ddp, optimizer=optimizer, counter=counter):
            x, y = batches[next(counter) % len(batches)]
            F.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        steps[name] = step
    samples = timing.compare(steps, rounds=rounds, warmup=3, device=ctx.device, shuffle=True,
                             progress=lambda r: ddplab.progress(r, ctx, desc))
    return {name: statistics.median(s) for name, s in timing.slowest_rank_per_step(samples).items()}


# --- 4. bucket size ---------------------------------------------------------------------------

def bucket_sweep(ctx, args) -> dict:
    """Step time of BucketedDDP and native DDP for each bucket cap.  All of them are timed in
    the same rounds (one step each, in shuffled order), so that a slow minute on a shared
    machine hits every cap alike instead of one."""
    model = book_model(ctx)
    batches = rank_batches(ctx, 4)
    caps = QUICK_SWEEP_CAPS_MB if ctx.quick else SWEEP_CAPS_MB
    variants = {"local": copy.deepcopy(model)}  # no communication at all: the floor
    for cap in caps:
        variants[f"bucketed {cap:g}"] = BucketedDDP(copy.deepcopy(model), cap)
        variants[f"native {cap:g}"] = native_ddp(copy.deepcopy(model), ctx, bucket_cap_mb=cap)
    ms = median_step_times(ctx, variants, batches, rounds=6 if ctx.quick else 25,
                           desc=f"bucket-size sweep ({len(variants)} variants)")
    points = [{"bucket_cap_mb": cap,
               "step_time_ms": {kind: ms[f"{kind} {cap:g}"] for kind in ("bucketed", "native")},
               "buckets": {"bucketed": len(variants[f"bucketed {cap:g}"].buckets),
                           "native": native_bucket_count(variants[f"native {cap:g}"])}}
              for cap in caps]
    extremes = {}
    for kind in ("bucketed", "native"):
        fastest = min(points, key=lambda p: p["step_time_ms"][kind])
        slowest = max(points, key=lambda p: p["step_time_ms"][kind])
        extremes[kind] = {"fastest_cap_mb": fastest["bucket_cap_mb"],
                          "fastest_ms": fastest["step_time_ms"][kind],
                          "slowest_cap_mb": slowest["bucket_cap_mb"],
                          "slowest_ms": slowest["step_time_ms"][kind]}
    same = all(p["buckets"]["bucketed"] == p["buckets"]["native"] for p in points)
    verdict = {kind: sweep_verdict(points, kind) for kind in ("bucketed", "native")}
    return {"points": points, "extremes": extremes, "local_step_time_ms": ms["local"],
            "verdict": verdict, "reading": sweep_reading(verdict),
            "same_bucket_counts_as_native": same,
            "default_cap": default_cap_layouts(ctx, model, batches),
            "gradient_mib": sum(p.numel() for p in model.parameters()) * 4 / MiB}


def native_bucket_sizes(ddp: DistributedDataParallel, key: str) -> list[int] | None:
    """Native DDP's bucket sizes in bytes, from its logging data (a private API): ``key`` is
    "bucket_sizes" (the first iteration's layout) or "rebuilt_bucket_sizes" (after the rebuild)."""
    try:
        sizes = ddp._get_ddp_logging_data().get(key)
    except (AttributeError, RuntimeError):
        return None
    return [int(v) for v in str(sizes).split(",")] if sizes else None


def native_bucket_count(ddp: DistributedDataParallel) -> int | None:
    """How many buckets native DDP uses after its first-iteration rebuild."""
    sizes = native_bucket_sizes(ddp, "rebuilt_bucket_sizes")
    return len(sizes) if sizes else None


def default_cap_layouts(ctx, model: nn.Module, batches) -> dict:
    """Bucket sizes (MiB) at native's default bucket_cap_mb=None and at an explicit 25: the sweep
    passes explicit caps only, and None is not the same as 25 (a 1 MiB first bucket)."""
    layouts = {}
    for name, cap in (("native_default", None), ("native_cap_25", 25.0)):
        ddp = native_ddp(copy.deepcopy(model), ctx, bucket_cap_mb=cap)
        for x, y in batches[:3]:  # the rebuild happens at the start of the second iteration
            F.cross_entropy(ddp(x), y).backward()
        for when, key in (("first_iteration", "bucket_sizes"), ("rebuilt", "rebuilt_bucket_sizes")):
            sizes = native_bucket_sizes(ddp, key) or []
            layouts.setdefault(name, {})[when] = {"count": len(sizes),
                                                  "mib": [b / MiB for b in sizes]}
    return layouts


def worker(ctx: ddplab.RankContext, args) -> dict | None:
    """Runs on every rank."""
    result = {"hook_order": hook_tour(), "post_accumulate_trap": post_accumulate_trap(),
              "gradient_ready": ready_order(ctx, args), "overlap": overlap_study(ctx, args),
              "bucket_sweep": bucket_sweep(ctx, args)}
    return result if ctx.is_main else None


# --- the summary (rank 0 / the launching process; the figures: scripts/drawing/chapter04.py) --

def summarize(r: dict, prov: dict) -> str:
    ready, overlap, sweep = r["gradient_ready"], r["overlap"], r["bucket_sweep"]
    trap = r["post_accumulate_trap"]
    rho = ready["rank_correlation_with_forward_order"]
    order = ready["ready_order"]
    steps = ", ".join(f"{k.replace('_', ' ')} {v:.1f} ms"
                      for k, v in overlap["step_time_ms"].items())
    sweep_line = ", ".join(f"{p['bucket_cap_mb']:g}: {p['step_time_ms']['bucketed']:.1f} | "
                           f"{p['step_time_ms']['native']:.1f}" for p in sweep["points"])
    hooks = " → ".join(f"{e['kind']} ({e['where']})" for e in r["hook_order"][:4])
    return "\n".join([
        f"Chapter 04 — {prov['world_size']} ranks on {prov['backend']} ({prov['device']})",
        f"Hooks, in firing order: {hooks} → …",
        f"post-accumulate-grad hook received the parameter: "
        f"{trap['hook_received_the_parameter']}; a 'halve the gradient' hook left the parameter "
        f"at {trap['parameter_after']} and the gradient at {trap['gradient_after']}",
        f"Gradient-ready order vs forward order: Spearman {rho:+.2f} (-1 = exactly reversed); "
        f"first ready: {order[0]}, last: {order[-1]}",
        f"Step time, {len(ready['buckets'])} buckets of ≤{overlap['bucket_cap_mb']:g} MiB: {steps}",
        f"Bucket sweep (cap MiB: bucketed | native ms): {sweep_line}",
    ])


def parse_args(argv: list[str] | None = None):
    parser = ddplab.chapter_parser(__doc__, prog="chapter04_hooks.py")
    parser.add_argument("--bucket-cap-mb", type=ddplab.positive(float), default=2.0, metavar="MIB",
                        help="bucket size for the ready-order and overlap figures (default: 2)")
    return ddplab.parse_chapter_args(parser, argv)


def overlap_trace(folder, metrics: dict, run: ddplab.Run) -> list[str]:
    write_chrome_trace(folder / "overlap_trace.json",
                       [Event(**e) for e in metrics["overlap"]["timelines"]["overlap"]])
    return ["overlap_trace.json"]


def main(argv: list[str] | None = None) -> dict | None:
    return run_chapter(CHAPTER, parse_args(argv), worker, finish=lambda args, run: run.result,
                       extras=overlap_trace, draw=drawing.chapter04.draw,
                       summarize=lambda metrics, run: summarize(metrics, run.provenance))


if __name__ == "__main__":
    sys.exit(ddplab.run_main(main))

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

Writes figures/chapter04/{hooks.png, ready_order.png, overlap.png, bucket_sweep.png,
overlap_trace.json, results.json} (or under --out DIR).  overlap_trace.json opens in
https://ui.perfetto.dev or chrome://tracing.
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
from ddplab import BucketedDDP, timing
from ddplab.bucketed_ddp import MiB, assign_buckets
from ddplab.models import ResidualMLP, make_clusters
from ddplab.timeline import Event, Timeline, gather_events, write_chrome_trace

CHAPTER = 4
BATCH = 128  # samples per rank per step
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

# --8<-- [start:timed_step]
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
# --8<-- [end:timed_step]


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def median_step_timeline(ctx, ddp: BucketedDDP, timeline: Timeline, batches,
                         steps: int) -> list[Event] | None:
    """Record ``steps`` steps; return (on rank 0) every rank's events of the median step."""
    optimizer = sgd(ddp)
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
        "native": native_ddp(copy.deepcopy(model), ctx, args.bucket_cap_mb),
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


def native_ddp(model: nn.Module, ctx, cap_mb: float) -> DistributedDataParallel:
    gpu = [ctx.local_rank] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=gpu, bucket_cap_mb=cap_mb)


def median_step_times(ctx, variants: dict[str, nn.Module], batches, rounds: int,
                      desc: str) -> dict[str, float]:
    """Median step time (ms, slowest rank) of each wrapped model, interleaved and shuffled."""
    steps = {}
    for name, ddp in variants.items():
        optimizer, counter = sgd(ddp), iter(range(10**9))

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
        variants[f"native {cap:g}"] = native_ddp(copy.deepcopy(model), ctx, cap)
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
    return {"points": points, "extremes": extremes, "local_step_time_ms": ms["local"],
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
        gpu = [ctx.local_rank] if ctx.device.type == "cuda" else None
        ddp = DistributedDataParallel(copy.deepcopy(model), device_ids=gpu, bucket_cap_mb=cap)
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


# --- drawing ---------------------------------------------------------------------------------

HOOK_COLORS = {"forward pre-hook": "forward", "forward hook": "forward",
               "tensor hook": "data", "full backward hook": "backward",
               "post-accumulate-grad hook": "comm", "queued callback": "optimizer",
               "backward starts": "wait", "backward returned": "wait"}


def draw_hooks(events: list[dict], path) -> None:
    from ddplab import plotting

    fig, ax = plotting.figure(height=0.26 * len(events) + 0.5)
    for i, event in enumerate(events):
        y = len(events) - 1 - i
        color = plotting.COLORS[HOOK_COLORS[event["kind"]]]
        ax.scatter([0], [y], s=60, color=color, zorder=3)
        ax.text(0.07, y, f"{i + 1}.", va="center", ha="right", fontsize=9)
        ax.text(0.08, y, event["kind"], va="center", fontsize=9)
        ax.text(0.5, y, event["where"], va="center", fontsize=9, color="#444444")
    ax.plot([0, 0], [0, len(events) - 1], color="#CCCCCC", zorder=1)
    ax.set_xlim(-0.05, 1.0)
    ax.set_ylim(-0.7, len(events) - 0.3)
    ax.axis("off")
    ax.set_title("The order hooks fire in: one forward and one backward", loc="left")
    plotting.save(fig, path)


def draw_ready_order(ready: dict, path) -> None:
    from ddplab import plotting

    params = ready["parameters"]
    fig, ax = plotting.figure(height=0.16 * len(params) + 1.2)
    palette = [plotting.OKABE_ITO[c] for c in ("orange", "blue", "green", "vermillion",
                                               "purple", "sky", "yellow", "black")]
    for i, p in enumerate(params):
        y = len(params) - 1 - i
        color = palette[p["bucket"] % len(palette)]
        ax.barh(y, p["ready_ms"], height=0.7, color=color)
    ax.set_yticks(range(len(params)), [p["name"] for p in reversed(params)], fontsize=7)
    ax.set_xlabel("gradient ready, ms after loss.backward() started")
    ax.set_title(f"Parameters in forward order (top = first layer); colour = bucket "
                 f"({ready['bucket_cap_mb']:g} MiB cap)", fontsize=10)
    buckets = sorted({p["bucket"] for p in params})
    handles = [plotting.plt.Rectangle((0, 0), 1, 1, color=palette[b % len(palette)])
               for b in buckets]
    ax.legend(handles, [f"bucket {b}" + (" (all-reduced first)" if b == 0 else "")
                        for b in buckets], loc="lower right", fontsize=8)
    ax.grid(axis="y", visible=False)
    plotting.save(fig, path)


def draw_step(ax, events: list[Event]) -> None:
    """One row of computation per rank, then one row per bucket (each all-reduce on its own row,
    from this rank's launch to its completion); the wait at the end of backward is labelled."""
    from ddplab import plotting

    rows = []
    for rank in sorted({e.rank for e in events}):
        lanes = sorted({e.name for e in events if e.rank == rank and e.cat == "comm"},
                       key=lambda n: (len(n), n))  # bucket 2 before bucket 10
        rows += [(rank, "compute")] + [(rank, lane) for lane in lanes]
    y_of = {row: len(rows) - 1 - i for i, row in enumerate(rows)}
    for e in events:
        y = y_of[(e.rank, e.name if e.cat == "comm" else "compute")]
        ax.broken_barh([(e.start_ms, max(e.duration_ms, 1e-3))], (y - 0.4, 0.8), linewidth=0,
                       color=plotting.COLORS.get(e.cat, plotting.OKABE_ITO["grey"]))
        if e.cat == "wait":  # labelled after the rank's last span, where there is room
            end = max(other.end_ms for other in events if other.rank == e.rank)
            ax.text(end + 1, y, f"wait {e.duration_ms:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(list(y_of.values()),
                  [f"rank {r}" if lane == "compute" else f"  {lane}" for r, lane in y_of],
                  fontsize=8)
    ax.grid(axis="y", visible=False)


def draw_overlap(overlap: dict, path) -> None:
    from matplotlib.patches import Patch

    from ddplab import plotting

    keys = [k for k in ("overlap", "no_overlap") if overlap["timelines"].get(k)]
    rows = sum(len({(e["rank"], e["name"]) for e in overlap["timelines"][k]}) for k in keys)
    fig, axes = plotting.figure(len(keys), 1, height=1.2 + 0.16 * rows, sharex=True,
                                layout="constrained", squeeze=False)
    titles = {"overlap": "overlap: each bucket is all-reduced as soon as it is full",
              "no_overlap": "overlap=False: all buckets wait for the end of backward"}
    for ax, key in zip(axes[:, 0], keys, strict=True):
        events = [Event(**e) for e in overlap["timelines"][key]]
        draw_step(ax, events)
        ax.set_title(f"{titles[key]} (median step {overlap['step_time_ms'][key]:.1f} ms)",
                     fontsize=10, loc="left")
    cats = sorted({e["cat"] for k in keys for e in overlap["timelines"][k]})
    axes[-1, 0].set_xlabel("ms since the step started (each rank's clock, started after a "
                           "barrier)")
    fig.legend(handles=[Patch(color=plotting.COLORS.get(c, plotting.OKABE_ITO["grey"]), label=c)
                        for c in cats], loc="outside upper center", ncol=len(cats))
    fig.text(0.5, -0.06, "A bucket's bar runs from this rank's launch to its completion. An "
             "all-reduce completes only once every rank has launched it,\nso the rank that "
             "finishes backward first waits for the other: its bars and its wait are longer.",
             ha="center", va="top", fontsize=8)
    plotting.save(fig, path)


def draw_sweep(sweep: dict, path, backend: str) -> None:
    from ddplab import plotting

    fig, ax = plotting.figure(height=3.3)
    caps = [p["bucket_cap_mb"] for p in sweep["points"]]
    for kind, label in (("native", "native DDP"), ("bucketed", "BucketedDDP")):
        values = [p["step_time_ms"][kind] for p in sweep["points"]]
        ax.plot(caps, values, marker="o", color=plotting.COLORS[kind], label=label)
    top = max(max(p["step_time_ms"].values()) for p in sweep["points"])
    for p in sweep["points"]:
        ax.annotate(str(p["buckets"]["bucketed"]), (p["bucket_cap_mb"], top * 1.04),
                    ha="center", fontsize=8, color="#444444")
    ax.axhline(sweep["local_step_time_ms"], color=plotting.COLORS["local"], linestyle="--")
    ax.text(caps[-1], sweep["local_step_time_ms"] * 0.92, "local step, no communication",
            ha="right", va="top", fontsize=8, color=plotting.COLORS["local"])
    ax.axvline(sweep["gradient_mib"], color=plotting.OKABE_ITO["grey"], linestyle=":")
    ax.text(sweep["gradient_mib"] * 1.08, top * 0.3,
            f"all gradients:\n{sweep['gradient_mib']:.1f} MiB", fontsize=8)
    ax.set_xscale("log")
    ax.set_xticks(caps, [f"{c:g}" for c in caps])
    ax.minorticks_off()
    ax.set_xlabel("bucket_cap_mb (MiB)")
    ax.set_ylabel("median step time (ms)")
    ax.set_ylim(0, top * 1.2)
    ax.set_title("Bucket size against step time (small numbers: BucketedDDP's bucket count)",
                 loc="left", fontsize=10)
    if backend == "gloo":  # say it on the figure, not only on the page
        ax.text(0.01, 0.04, "CPU ranks over gloo: communication runs on the same cores as "
                "backward,\nso overlap buys little and no bucket size can win much here",
                transform=ax.transAxes, fontsize=8, color="#444444")
    ax.legend(loc="center left")
    plotting.save(fig, path)


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


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    run = ddplab.launch(worker, args)
    if run is None:  # a non-zero rank under torchrun: rank 0 writes the files
        return None
    result = run.result
    with ddplab.chapter_output(args.out, CHAPTER) as out:
        draw_hooks(result["hook_order"], out / "hooks.png")
        draw_ready_order(result["gradient_ready"], out / "ready_order.png")
        draw_overlap(result["overlap"], out / "overlap.png")
        draw_sweep(result["bucket_sweep"], out / "bucket_sweep.png", run.provenance["backend"])
        write_chrome_trace(out / "overlap_trace.json",
                           [Event(**e) for e in result["overlap"]["timelines"]["overlap"]])
        ddplab.write_results(out, CHAPTER, result, run.provenance)
    print(summarize(result, run.provenance))
    print(f"wrote {args.out / f'chapter{CHAPTER:02d}'}/{{hooks.png, ready_order.png, "
          "overlap.png, bucket_sweep.png, overlap_trace.json, results.json}")
    return result


if __name__ == "__main__":
    sys.exit(ddplab.run_main(main))

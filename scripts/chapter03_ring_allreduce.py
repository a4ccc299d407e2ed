"""Chapter 03 — ring all-reduce from send/recv, checked, traced and benchmarked.

Builds an all-reduce out of point-to-point messages (``ddplab.ring_all_reduce``: a
reduce-scatter phase, then an all-gather phase), checks it against ``dist.all_reduce`` for many
sizes and dtypes, records which chunk moves where at every step, and times it against
``dist.all_reduce`` and a naive gather-to-rank-0 all-reduce from 4 KiB to 64 MiB (10th
percentiles over the rounds), algorithm and bus bandwidth as nccl-tests defines them, and the
alpha-beta cost model fitted to each.  Then it varies the segment size, and (when it starts
the ranks itself) the world size.

Run it:
    python scripts/chapter03_ring_allreduce.py                  # 2 CPU ranks, started by mp.spawn
    python scripts/chapter03_ring_allreduce.py --quick          # 4 KiB … 16 MiB, fewer rounds
    python scripts/chapter03_ring_allreduce.py --world-size 4
    torchrun --standalone --nproc-per-node 2 scripts/chapter03_ring_allreduce.py  # no N sweep
    make run-chapter03
    python scripts/chapter03_ring_allreduce.py --replot         # only redraw the figures

Writes out/chapter03/{ring_steps.png, time.png, busbw.png, segments.png, scaling.png,
ring_steps.json, results.json} (or under --out DIR); the figures are drawn from the two JSON
files alone (scripts/drawing/chapter03.py).
"""

from __future__ import annotations

import math
import statistics
import sys
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

import ddplab
import drawing.chapter03
from backstage import chapter03 as report
from backstage.chapter03 import (
    label_bytes,
    stall_summary,
    summarize,
)
from ddplab import ring
from ddplab.ring import SEGMENT_BYTES, RingStep, naive_all_reduce, ring_all_reduce
from ddplab.run import timing
from ddplab.run.chapter_main import run_chapter, the_folder
from ddplab.run.cli import with_changes
from ddplab.run.devices import gpu_count
from ddplab.run.fitting import non_negative_lstsq, weighted_r2
from ddplab.run.ranks import point_to_point_context
from ddplab.run.replot import write_figure_data

CHAPTER = 3
KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB * 2**i for i in range(15)]  # 4 KiB … 64 MiB
QUICK_SIZES = [4 * KiB * 4**i for i in range(7)]  # 4 KiB … 16 MiB: enough for β to show
SEGMENTS = [64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB, 4 * MiB, 16 * MiB, None]  # None: 1 per chunk
QUICK_SEGMENTS = [64 * KiB, 256 * KiB, 2 * MiB, None]
SWEEP_WORLD_SIZES = (2, 3, 4)
# The benchmark times the all-reduces as a training loop calls them: the sizes were agreed
# once, so the hand-written ones skip their per-call size check (timed on its own, below).
IMPLS = {"ring": partial(ring_all_reduce, check=False), "native": dist.all_reduce,
         "naive": partial(naive_all_reduce, check=False)}
# The correctness checks run the page's textbook ring, and the fast ones both with the size
# check (the default) and without.
VARIANTS = {"textbook": ring.textbook_ring_all_reduce, "ring": ring_all_reduce,
            "naive": naive_all_reduce, "ring_unchecked": IMPLS["ring"],
            "naive_unchecked": IMPLS["naive"]}


# --- correctness --------------------------------------------------------------------------------

def check_sizes(world: int) -> list[int]:
    """Sizes that catch the usual bugs: empty, smaller than N, not a multiple of N, large+odd."""
    return sorted({0, 1, max(world - 1, 1), world + 1, 7, 13, 1_000_003})


# --8<-- [start:check]
def compare_with_native(impl, x: torch.Tensor) -> dict:
    """Run ``impl`` and ``dist.all_reduce`` on copies of ``x``; how far apart are they?

    Integers must match exactly.  Floats are summed in a different order by the two
    implementations, and float addition is not associative.  Summing N numbers in any order
    is off by at most (N-1)·u·Σ|x_i| (u = eps/2, the unit roundoff; to first order in u), so
    two orders differ by at most (N-1)·eps·Σ|x_i|: that is the tolerance, element by element.
    """
    ours, reference = x.clone(), x.clone()
    impl(ours)
    dist.all_reduce(reference)
    diff = (ours.double() - reference.double()).abs()
    if not x.is_floating_point():
        bound = torch.zeros_like(diff)
    else:
        magnitude = x.double().abs()
        dist.all_reduce(magnitude)  # Σ|x_i| over the ranks, element by element
        bound = (dist.get_world_size() - 1) * torch.finfo(x.dtype).eps * magnitude
    return {"max_abs_diff": diff.max().item() if diff.numel() else 0.0,
            "bitwise_equal": torch.equal(ours, reference),
            "within_bound": bool((diff <= bound).all())}
# --8<-- [end:check]


def random_tensor(size: int, dtype: torch.dtype, rank: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)  # different data on every rank
    if dtype.is_floating_point:
        return torch.randn(size, generator=g, dtype=dtype).to(device)
    return torch.randint(-10**6, 10**6, (size,), generator=g, dtype=dtype).to(device)


def correctness(ctx: ddplab.RankContext) -> list[dict]:
    rows = []
    for size in check_sizes(ctx.world_size):
        for dtype in (torch.float32, torch.float64, torch.int64):
            x = random_tensor(size, dtype, ctx.rank, ctx.seed, ctx.device)
            for name, impl in VARIANTS.items():
                rows.append({"impl": name, "size": size, "dtype": str(dtype).split(".")[-1],
                             **compare_with_native(impl, x)})
    return rows


# --- the step-by-step trace ---------------------------------------------------------------------

# --8<-- [start:trace]
def record_trace(ctx: ddplab.RankContext) -> list[list[dict]]:
    """Run the ring on a tensor of one element per chunk, where rank r holds 2**r everywhere.

    Any sum of such values is a bit mask of the ranks it contains (2**0 + 2**2 = 0b101: ranks 0
    and 2), so after each step a chunk's value says exactly which ranks' data it holds.
    """
    steps: list[dict] = []

    def record(step: RingStep) -> None:
        steps.append({"phase": step.phase, "step": step.step, "rank": step.rank,
                      "sent": step.sent_chunk, "received": step.received_chunk,
                      "masks": [int(c[0]) for c in step.chunks]})

    x = torch.full((ctx.world_size,), 2**ctx.rank, dtype=torch.int64, device=ctx.device)
    start = {"phase": "start", "step": -1, "rank": ctx.rank, "sent": None, "received": None,
             "masks": x.tolist()}
    ring_all_reduce(x, trace=record)
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, [start, *steps])
    return everyone  # everyone[rank][i]: that rank's state after step i
# --8<-- [end:trace]


# --- the benchmark ------------------------------------------------------------------------------

def rounds_for(size: int, quick: bool) -> int:
    """Many rounds where a round is cheap: below a millisecond, timings on a shared 2-core
    machine are bimodal (see ``round_times``).  Many again at the largest sizes, where the
    ring and gloo differ by a few per cent."""
    if quick:
        return 60 if size <= 1 * MiB else 15
    return 100 if size <= 1 * MiB else 40


def warm_up(ctx: ddplab.RankContext, sizes: list[int], impls: dict) -> None:
    """One untimed pass over every size, then more calls at the smallest: the first calls of a
    process are slow (allocator, caches, gloo's threads), and would inflate the first size."""
    for size in sizes:
        x = torch.randn(size // 4, device=ctx.device)
        for impl in impls.values():
            for _ in range(1 if size > sizes[0] else 30):
                impl(x)


# --8<-- [start:statistic]
STATISTICS = ("time_ms", "median_ms", "stalled", "stall_ms")
STALLED = 2  # a round that took over twice the 10th percentile stalled (see the page)


def round_times(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Each round took as long as its slowest rank.  Over the rounds, per implementation: the
    10th percentile (what the chapter plots and fits), the median, the share of rounds that
    stalled, and how much longer a stalled round took (its median excess, ms)."""
    summary = {}
    for name, rounds in timing.slowest_rank_per_step(samples).items():
        fast = statistics.quantiles(rounds, n=10, method="inclusive")[0]  # 10th percentile
        excess = [t - fast for t in rounds if t > STALLED * fast]
        summary[name] = {"time_ms": fast, "median_ms": statistics.median(rounds),
                         "stalled": len(excess) / len(rounds),
                         "stall_ms": statistics.median(excess) if excess else 0.0}
    return summary
# --8<-- [end:statistic]


def typical_ms(samples: list[float]) -> float:
    """One measurement timed on every rank: its 10th percentile over the rounds (ms)."""
    return round_times({"x": samples})["x"]["time_ms"]


# --8<-- [start:benchmark]
def benchmark(ctx: ddplab.RankContext, sizes: list[int], impls: dict) -> dict[str, dict]:
    """Each implementation at each size, timed A B C, A B C, …: for every statistic of
    ``round_times``, one list over the sizes per implementation."""
    stats: dict[str, dict] = {key: {name: [] for name in impls} for key in STATISTICS}
    warm_up(ctx, sizes, impls)
    for size in ddplab.progress(sizes, ctx, "sizes"):
        x = torch.randn(size // 4, device=ctx.device)  # float32: 4 bytes per element
        steps = {name: partial(impl, x) for name, impl in impls.items()}
        samples = timing.compare(steps, rounds=rounds_for(size, ctx.quick), warmup=2,
                                 device=ctx.device)
        for name, summary in round_times(samples).items():
            for key in STATISTICS:
                stats[key][name].append(summary[key])
    return stats
# --8<-- [end:benchmark]


def segment_sweep(ctx: ddplab.RankContext, size: int, segments: list[int | None]) -> list[float]:
    """Time the ring at one size with different segment sizes (None: whole chunks)."""
    x = torch.randn(size // 4, device=ctx.device)
    steps = {str(seg): partial(ring_all_reduce, x, check=False, segment_bytes=seg or size)
             for seg in segments}
    samples = timing.compare(steps, rounds=5 if ctx.quick else 20, warmup=1, device=ctx.device)
    return [round_times(samples)[str(seg)]["time_ms"] for seg in segments]


def size_check_cost(ctx: ddplab.RankContext) -> dict[str, float]:
    """What the size agreement of ring_all_reduce(check=True) costs on its own (ms), and its
    all-reduce of four integers alone, in the same rounds: the rest is the Python around it."""
    from ddplab.ring import check_same_tensor

    x = torch.zeros(1, device=ctx.device)
    four = torch.zeros(4, dtype=torch.int64, device=ctx.device)
    steps = {"check": lambda: check_same_tensor(x),
             "all_reduce": lambda: dist.all_reduce(four, op=dist.ReduceOp.MAX)}
    times = round_times(timing.compare(steps, rounds=30, device=ctx.device))
    return {name: times[name]["time_ms"] for name in steps}


def add_cost(ctx: ddplab.RankContext) -> float:
    """γ: seconds per byte for ``a.add_(b)`` on one rank, no communication (every rank at once,
    as in the ring).  A size sweep cannot tell γ from β (both grow with S): measure it alone."""
    a, b = (torch.randn(SEGMENT_BYTES // 4, device=ctx.device) for _ in range(2))
    ms = typical_ms(timing.time_steps(lambda: a.add_(b), steps=10 if ctx.quick else 30,
                                      device=ctx.device))
    return ms * 1e-3 / SEGMENT_BYTES


def worker(ctx: ddplab.RankContext, args) -> dict | None:
    """Runs on every rank: check, trace, benchmark."""
    ctx = point_to_point_context(ctx)  # a GPU shared over gloo: CPU tensors (gloo's p2p)
    sizes = QUICK_SIZES if ctx.quick else SIZES
    result = {"correctness": correctness(ctx), "trace": record_trace(ctx), "sizes": sizes}
    stats = benchmark(ctx, sizes, IMPLS)
    result |= {"times_ms": stats["time_ms"], "median_ms": stats["median_ms"],
               "stalled": stats["stalled"], "stall_ms": stats["stall_ms"],
               "size_check": size_check_cost(ctx), "gamma_s_per_byte": add_cost(ctx)}
    segments = QUICK_SEGMENTS if ctx.quick else SEGMENTS
    result["segments"] = {"size": sizes[-1], "segment_bytes": segments,
                          "times_ms": segment_sweep(ctx, sizes[-1], segments)}
    return result if ctx.is_main else None


def sweep_worker(ctx: ddplab.RankContext, args) -> dict | None:
    """Runs on every rank of a world-size sweep launch: one size, the three implementations."""
    ctx = point_to_point_context(ctx)  # a GPU shared over gloo: CPU tensors (gloo's p2p)
    size = sweep_size(ctx.quick)
    times = benchmark(ctx, [size], IMPLS)["time_ms"]
    result = {"times_ms": {name: t[0] for name, t in times.items()}, "trace": record_trace(ctx)}
    return result if ctx.is_main else None


def sweep_size(quick: bool) -> int:
    return 1 * MiB if quick else 16 * MiB


# --- analysis -------------------------------------------------------------------------------------

def bus_factor(world: int) -> float:
    """nccl-tests: all-reduce busbw = algbw · 2(N-1)/N, the fraction each rank's link carries."""
    return 2 * (world - 1) / world


# --8<-- [start:fit]
def fit_alpha_beta(sizes: list[int], times_ms: list[float], world: int, sent: float,
                   added: float, gamma: float) -> dict:
    """Fit t = 2(N-1)·α + sent·S·β + added·S·γ by least squares on relative error.

    sent, added: bytes the busiest rank sends and adds per byte of tensor (ring: 2(N-1)/N and
    (N-1)/N).  γ was measured on its own; α and β are fitted.  Weighting each point by 1/t
    makes a 4 KiB point count as much as a 64 MiB one (plain least squares fits the largest).
    """
    s = np.asarray(sizes, dtype=float)
    t = np.asarray(times_ms, dtype=float) * 1e-3  # seconds
    adding = added * s * gamma  # the γ term: known, so it is taken out before the fit
    design = np.column_stack([np.full_like(s, 2 * (world - 1)), sent * s])
    w = 1 / t
    alpha, beta = non_negative_lstsq(design * w[:, None], (t - adding) * w)
    predicted = design @ [alpha, beta] + adding
    rel_err = (predicted - t) / t
    return {"alpha_us": alpha * 1e6, "beta_gbps": 1e-9 / beta if beta > 0 else None,
            "r2": weighted_r2(t, predicted, w), "max_rel_err": float(np.abs(rel_err).max()),
            "rel_err": {str(size): float(e) for size, e in zip(sizes, rel_err, strict=True)},
            "gamma_share_largest": float(adding[-1] / predicted[-1]),
            "predicted_ms": {str(size): float(p) * 1e3 for size, p in zip(sizes, predicted,
                                                                           strict=True)}}
# --8<-- [end:fit]


def traffic(impl: str, world: int) -> tuple[float, float]:
    """Bytes the busiest rank sends, and adds, per byte of tensor.  Ring (and gloo's ring):
    2(N-1)/N and (N-1)/N.  Naive: rank 0 receives (N-1)·S, adds it, and only then sends
    (N-1)·S, so its link carries 2(N-1)·S one after the other."""
    if impl == "naive":
        return 2 * (world - 1), world - 1
    return bus_factor(world), (world - 1) / world


def analyse(result: dict, world: int) -> dict:
    sizes, times, medians = result["sizes"], result["times_ms"], result["median_ms"]
    algbw = {name: [s / (t * 1e-3) / 1e9 for s, t in zip(sizes, ts, strict=True)]
             for name, ts in times.items()}
    busbw = {name: [bw * bus_factor(world) for bw in bws] for name, bws in algbw.items()}
    per_size = lambda values: {str(s): v for s, v in zip(sizes, values, strict=True)}  # noqa: E731
    gamma = result["gamma_s_per_byte"]
    fits = {name: fit_alpha_beta(sizes, times[name], world, *traffic(name, world), gamma)
            for name in times} if world > 1 else {}
    # busbw ratio = gloo's time / the ring's time.  One rank sends nothing: no busbw, no ratio.
    ratio = [n / r if world > 1 else None
             for r, n in zip(times["ring"], times["native"], strict=True)]
    metrics = {
        "correct": all(row["within_bound"] for row in result["correctness"]),
        "sizes_bytes": sizes,
        "time_ms": {name: per_size(ts) for name, ts in times.items()},
        "median_ms": {name: per_size(ts) for name, ts in medians.items()},
        "stalled_share": {name: per_size(v) for name, v in result["stalled"].items()},
        "algbw_gbps": {name: per_size(v) for name, v in algbw.items()},
        "busbw_gbps": {name: per_size(v) for name, v in busbw.items()},
        "ratio_ring_to_native_busbw": per_size(ratio),
        "alpha_beta": fits,
        "largest": {"size_bytes": sizes[-1], "size_mib": sizes[-1] / MiB,
                    "ratio_ring_to_native_busbw": ratio[-1],
                    "busbw_gbps": {name: busbw[name][-1] for name in busbw},
                    "time_ms": {name: times[name][-1] for name in times}},
        "smallest": {"size_bytes": sizes[0], "size_kib": sizes[0] / KiB,
                     "time_ms": {name: times[name][0] for name in times},
                     "ratio_ring_to_native_time": times["ring"][0] / times["native"][0],
                     "ratio_ring_to_native_median": medians["ring"][0] / medians["native"][0]},
        "stalls": stall_summary(sizes, result),
        "size_check_us": result["size_check"]["check"] * 1e3,
        "size_check_all_reduce_us": result["size_check"]["all_reduce"] * 1e3,
        "size_check_share_of_alpha": 1 / (2 * (world - 1)) if world > 1 else None,
        "gamma_gbps": 1e-9 / result["gamma_s_per_byte"],
        "correctness": report.correctness_summary(result["correctness"], world),
        "segments": segment_summary(result["segments"], result["times_ms"], world),
    }
    if world == 1:
        metrics["one_rank"] = ONE_RANK
        return metrics
    metrics["per_call"] = report.per_call_costs(fits["ring"], metrics["segments"], world)
    metrics["goals"] = report.goals(metrics)
    metrics["verdicts"] = report.verdicts(metrics)  # the page's comparisons, computed
    return metrics


ONE_RANK = ("1 rank: an all-reduce has nothing to exchange (the sum of one tensor is itself), "
            "so no byte crosses a link and busbw is not defined; run with --world-size 2 or more")


def segment_summary(seg: dict, times: dict, world: int) -> dict:
    size = seg["size"]
    rows = [{"segment_bytes": s, "segment_label": label_bytes(s) if s else "whole chunk",
             "time_ms": t, "busbw_gbps": size / (t * 1e-3) / 1e9 * bus_factor(world)}
            for s, t in zip(seg["segment_bytes"], seg["times_ms"], strict=True)]
    by_size = {r["segment_bytes"]: r["time_ms"] for r in rows}
    default = by_size.get(SEGMENT_BYTES)
    # Each rank sends one message per segment per step: 2(N-1) steps of ceil(chunk/segment).
    messages = {seg: 2 * (world - 1) * math.ceil(size / world / (seg or size)) for seg in by_size}
    smallest = min(s for s in by_size if s)
    per_message = ((by_size[smallest] - default) / (messages[smallest] - messages[SEGMENT_BYTES])
                   if default and messages[smallest] > messages[SEGMENT_BYTES] else None)
    return {"size_bytes": size, "size_label": label_bytes(size), "rows": rows,
            "extra_ms_per_message": per_message,
            "best": min(rows, key=lambda r: r["time_ms"])["segment_label"],
            "default_segment": label_bytes(SEGMENT_BYTES),
            "whole_chunk_over_default_time": by_size[None] / default if default else None,
            # one message per chunk also means a chunk-sized receive buffer (kept between calls)
            "whole_chunk_scratch_mib": math.ceil(size / world) / MiB,
            "native_busbw_gbps": size / (times["native"][-1] * 1e-3) / 1e9 * bus_factor(world)}


# --- the world-size sweep (only when this script starts the ranks) --------------------------------

def world_size_sweep(args, main_world: int, main_result: dict,
                     backend: str) -> tuple[dict, list]:
    """Launch once per world size (the main run already measured its own); returns the
    timings and the step-by-step trace of the largest world size.

    Every launch uses the main run's backend, so the points are comparable: with nccl, only
    world sizes that have a GPU per rank (--backend auto would fall back to gloo on CPU).
    """
    size = sweep_size(args.quick)
    gpus = gpu_count()
    worlds = [w for w in SWEEP_WORLD_SIZES if backend != "nccl" or w <= gpus]
    rows, traces = {}, {main_world: main_result["trace"]}
    for world in worlds:
        if world == main_world:
            i = main_result["sizes"].index(size)
            rows[world] = {name: ts[i] for name, ts in main_result["times_ms"].items()}
            continue
        run = ddplab.launch(sweep_worker, with_changes(args, world_size=world, backend=backend))
        rows[world] = run.result["times_ms"]
        traces[world] = run.result["trace"]
    scaling = {"size_bytes": size, "size_label": label_bytes(size), "world_sizes": list(rows),
               "time_ms": {name: {str(w): rows[w][name] for w in rows} for name in IMPLS}}
    return scaling, traces[max(traces)]


# --- main -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None):
    parser = ddplab.chapter_parser(__doc__, prog="chapter03_ring_allreduce.py")
    return ddplab.parse_chapter_args(parser, argv)


def finish(args, run: ddplab.Run) -> dict:
    """results.json: the fits and verdicts, and the world-size sweep when this process started
    the ranks.  The trace drawn is the largest world size's."""
    world = run.provenance["world_size"]
    metrics = analyse(run.result, world)
    if run.provenance["launcher"] == "torchrun":
        note = "skipped under torchrun: the sweep starts its own ranks (run without torchrun)"
        print(f"note: world-size sweep {note}")
        metrics["scaling"] = {"skipped": note}
    else:
        metrics["scaling"], run.result["trace"] = world_size_sweep(args, world, run.result,
                                                                   run.provenance["backend"])
    metrics["trace_world_size"] = len(run.result["trace"])
    return metrics


def ring_steps(folder, metrics: dict, run: ddplab.Run) -> list[str]:
    write_figure_data(folder, "ring_steps.json", run.result["trace"])  # every rank's chunks
    return ["ring_steps.json"]                                           # after each step


def main(argv: list[str] | None = None) -> dict | None:
    return run_chapter(CHAPTER, parse_args(argv), worker, finish=finish,
                       draw=drawing.chapter03.draw,
                       extras=ring_steps, summarize=lambda metrics, run: summarize(metrics),
                       wrote=the_folder)


if __name__ == "__main__":
    sys.exit(ddplab.run_main(main))

"""Chapter 06 — bubbles: where data-parallel ranks wait, measured and drawn.

Every rank records what it does and when (forward, backward, each bucket's all-reduce, the
optimizer step) for native DDP and for ddplab.BucketedDDP; one rank is then made late on
purpose, by a sweep of delays, and the others' idle time is measured against the delay.  Then
the other sync points: a loss reduced every step, BatchNorm against SyncBatchNorm, work done on
rank 0 only, and ranks with different numbers of batches (a hang without Join, a clean finish
with it).  The two hangs run as their own short jobs that time out on purpose.

Run it:
    python scripts/chapter06_bubbles.py                     # 2 CPU ranks, started by mp.spawn
    python scripts/chapter06_bubbles.py --quick             # fewer steps and delays (< 1 min)
    python scripts/chapter06_bubbles.py --delays 0,25,50 --slow-rank 0
    torchrun --standalone --nproc-per-node 2 scripts/chapter06_bubbles.py   # hang demos skipped
    make run-chapter06
    python scripts/chapter06_bubbles.py --replot            # only redraw the figures

Writes out/chapter06/: timeline_native.png, timeline_bucketed.png, straggler.png,
straggler_timeline.png, sync_points.png, syncbn_timeline.png, rank0_work.png, uneven_join.png,
the Chrome/Perfetto traces trace_native_ddp.json, trace_bucketed_ddp.json, trace_straggler.json
(open them at https://ui.perfetto.dev), on GPUs also torch.profiler traces
profiler_rank<N>.json, and results.json (or under --out DIR).  The figures are drawn from
results.json alone (scripts/drawing/chapter06.py).
"""

from __future__ import annotations

import io
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

import ddplab
import drawing.chapter06
from backstage import chapter06_report as report
from backstage import chapter06_workbench
from backstage.chapter06_syncbn import batchnorm_vs_syncbn, syncbn_timeline
from backstage.chapter06_workbench import mlp, native_ddp, rank_batch, record_timeline, sgd, wrapped
from ddplab import stragglers
from ddplab.run import hangs, timeline
from ddplab.run.chapter_main import run_chapter
from ddplab.run.timing import compare, median, slowest_rank, synchronize

CHAPTER = 6
HANG_TIMEOUT_S = 3.0      # how long the two hang demonstrations wait before giving up
EXPECTED_SLOPE = 1.0      # each ms the late rank loses is one ms every other rank waits
DELAYS = {"quick": [0, 10, 20, 30, 40], "full": [0, 5, 10, 15, 20, 25, 30, 40]}
BUBBLE_DELAY_MS = 20.0    # the delay drawn on the straggler timeline


# --- one training step; the models and each rank's batch: scripts/backstage/chapter06_workbench.py

# --8<-- [start:step]
def train_step(model, opt, x, y, tl: timeline.Timeline, late_ms: float = 0.0):
    """One step, each phase a span on the timeline.  ``late_ms``: this rank is late."""
    if late_ms:
        with tl.span(f"late by {late_ms:g} ms", "data"):
            stragglers.inject_delay(late_ms)
    with tl.span("forward", "forward"):
        loss = F.cross_entropy(model(x), y)
    with tl.span("backward", "backward"):
        loss.backward()      # DDP all-reduces the gradient buckets during this call
    with tl.span("optimizer step", "optimizer"):
        opt.step()
        opt.zero_grad()
    return loss
# --8<-- [end:step]


# --- 1. timelines ------------------------------------------------------------------------------
# On a GPU, torch.profiler's own trace as well: chapter06_workbench.profiler_traces.

def mlp_timeline(ctx, kind: str, steps: int, late_ms: float = 0.0):
    """A few steps of the MLP on one shared clock (chapter06_workbench.record_timeline)."""
    tl = timeline.Timeline(ctx.rank, device=ctx.device)
    x, y = rank_batch(ctx, (64, 256))
    return record_timeline(ctx, wrapped(kind, ctx, tl), tl, x, y, train_step, steps=steps,
                           late_ms=late_ms)


# --- 2. stragglers -----------------------------------------------------------------------------
# The sweep's fitted slopes: scripts/backstage/chapter06_report.py, summarize_sweep.

# --8<-- [start:sweep]
def straggler_sweep(ctx, kind: str, delays: list[float], slow_rank: int, steps: int) -> dict:
    """For each delay: median step time and idle time of every rank (all ranks get the lists)."""
    tl = timeline.Timeline(ctx.rank, device=ctx.device)
    model = wrapped(kind, ctx, tl)
    opt = sgd(model)
    x, y = rank_batch(ctx, (64, 256))
    mine: dict[str, list[float]] = {"step_ms": [], "idle_ms": [], "wait_span_ms": []}
    for delay in ddplab.progress(delays, ctx, f"straggler sweep ({kind})"):
        late = delay if ctx.rank == slow_rank else 0.0
        for _ in range(2):
            train_step(model, opt, x, y, tl, late)
        step_ms, idle_ms, wait_ms = [], [], []
        for _ in range(steps):
            dist.barrier()       # every step starts together: the delay is the only skew
            tl.start_clock()
            train_step(model, opt, x, y, tl, late)
            step_ms.append(tl.elapsed_ms())
            idle_ms.append(stragglers.comm_idle_ms(tl.events, ctx.rank))
            wait_ms.append(sum(e.duration_ms for e in tl.events if e.cat == "wait"))
        mine["step_ms"].append(median(step_ms))
        mine["idle_ms"].append(median(idle_ms))
        mine["wait_span_ms"].append(median(wait_ms))
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return {"per_rank": everyone}
# --8<-- [end:sweep]


# --- 3. sync points ----------------------------------------------------------------------------
# BatchNorm against SyncBatchNorm, the sync points inside a model:
# scripts/backstage/chapter06_syncbn.py

def hook_cost(ctx, rounds: int) -> dict:
    """What replacing DDP's built-in (C++) all-reduce by a Python hook costs, and whether the
    numbers change: torch's own Python ``allreduce_hook``, and our timing hook."""
    models = {}
    for name in ("built_in", "python_allreduce_hook", "timing_hook"):
        torch.manual_seed(ctx.seed)   # the same initial weights for all three
        if name == "timing_hook":
            models[name] = wrapped("native", ctx, timeline.Timeline(ctx.rank, device=ctx.device))
            continue
        models[name] = native_ddp(mlp(), ctx)
        if name == "python_allreduce_hook":
            models[name].register_comm_hook(None, default_hooks.allreduce_hook)
    opts = {name: sgd(m) for name, m in models.items()}
    x, y = rank_batch(ctx, (64, 256))
    quiet = timeline.Timeline(ctx.rank, enabled=False)

    def step(name):
        return lambda: train_step(models[name], opts[name], x, y, quiet)
    samples = compare({name: step(name) for name in models}, rounds=rounds, warmup=3,
                      device=ctx.device)
    diff = max((a - b).abs().max().item() for other in ("python_allreduce_hook", "timing_hook")
               for a, b in zip(models["built_in"].parameters(), models[other].parameters(),
                               strict=True))
    return {"step_time_ms": {k: median(v) for k, v in samples.items()},
            "max_abs_diff_params": slowest_rank(diff)}


# --8<-- [start:metric]
def reduce_loss_every_step(loss: torch.Tensor) -> float:
    """The common logging pattern: average the loss over ranks, every step, for printing."""
    averaged = loss.detach().clone()
    dist.all_reduce(averaged)   # a blocking collective: every rank must arrive
    return averaged.item() / dist.get_world_size()  # .item(): on a GPU, a host-device sync too
# --8<-- [end:metric]


def metric_reduction(ctx, rounds: int) -> dict:
    """Step time with and without the per-step loss all-reduce, and the time inside it.

    On a GPU each sample is a window of steps with no synchronisation inside it: without the
    logging the CPU queues the next steps' kernels while the GPU works, and ``.item()`` is what
    stops that.  (On CPU there is no queue to run ahead in: one step per sample.)
    """
    torch.manual_seed(ctx.seed)
    model = native_ddp(mlp(), ctx)
    opt = sgd(model)
    x, y = rank_batch(ctx, (64, 256))
    quiet = timeline.Timeline(ctx.rank, enabled=False)
    tl = timeline.Timeline(ctx.rank, device=ctx.device)
    window = 10 if ctx.device.type == "cuda" else 1

    def plain():
        return train_step(model, opt, x, y, quiet)

    def logged():
        loss = plain()
        with tl.span("loss all-reduce", "comm"):
            reduce_loss_every_step(loss)

    def windowed(step):
        return lambda: [step() for _ in range(window)]
    samples = compare({"without": windowed(plain), "with": windowed(logged)}, rounds=rounds,
                      warmup=3, device=ctx.device)
    return {"step_time_ms": {k: median(v) / window for k, v in samples.items()},
            "steps_per_sample": window,
            "reduce_ms": median([e.duration_ms for e in tl.events]),
            "collectives_per_step": {"without": stragglers.count_collectives(plain),
                                     "with": stragglers.count_collectives(logged)}}


# --8<-- [start:rank0_work]
def evaluate_and_save(model: nn.Module, batches, device) -> None:
    """What rank 0 typically does alone between steps: evaluate, then checkpoint."""
    with torch.no_grad():
        for x, _ in batches:
            model(x)
    torch.save(model.state_dict(), io.BytesIO())
    synchronize(device)


def rank0_work(ctx, steps: int = 4, after_step: int = 1):
    tl = timeline.Timeline(ctx.rank, device=ctx.device)
    model = wrapped("native", ctx, tl)
    opt = sgd(model)
    x, y = rank_batch(ctx, (64, 256))
    val = [rank_batch(ctx, (64, 256), salt=2 + i) for i in range(40)]
    for _ in range(3):
        train_step(model, opt, x, y, tl)
    dist.barrier()
    tl.start_clock()
    for step in range(steps):
        train_step(model, opt, x, y, tl)
        if step == after_step and ctx.rank == 0:   # the other ranks go straight on
            with tl.span("evaluate + save (rank 0 only)", "eval"):
                evaluate_and_save(model.module, val, ctx.device)
    return timeline.gather_events(tl)
# --8<-- [end:rank0_work]


# --- 4. uneven inputs --------------------------------------------------------------------------

DATASET_SIZE, BATCH = 101, 10  # 101 samples: no way to give 2 ranks the same number


# --8<-- [start:uneven_shards]
def my_batches(ctx) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A hand-made shard: every world_size-th sample, cut into batches.  101 samples on 2
    ranks: rank 0 gets 51 (6 batches), rank 1 gets 50 (5 batches)."""
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(DATASET_SIZE, 32, generator=g), torch.randint(0, 4, (DATASET_SIZE,),
                                                                        generator=g)
    mine = list(range(ctx.rank, DATASET_SIZE, ctx.world_size))
    return [(xs[mine[i:i + BATCH]].to(ctx.device), ys[mine[i:i + BATCH]].to(ctx.device))
            for i in range(0, len(mine), BATCH)]
# --8<-- [end:uneven_shards]


def small_model(ctx) -> DDP:
    torch.manual_seed(ctx.seed)
    return native_ddp(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)), ctx)


# --8<-- [start:join]
def train_with_join(ctx, model: DDP, tl: timeline.Timeline) -> int:
    """Uneven batches, finished cleanly: a rank that runs out joins, and shadows the others'
    collectives (zeros for its gradients) until every rank is done."""
    opt = sgd(model)
    batches = my_batches(ctx)
    with Join([model]):
        for x, y in batches:
            train_step(model, opt, x, y, tl)
        out_of_data = tl.now()
    tl.add("joined: shadowing the others' all-reduces", "join", out_of_data, tl.now())
    return len(batches)
# --8<-- [end:join]


# --8<-- [start:throw]
def train_with_join_that_throws(ctx) -> str:
    """``throw_on_early_termination=True``: every rank raises as soon as one runs out."""
    model = small_model(ctx)
    opt = sgd(model)
    quiet = timeline.Timeline(ctx.rank, enabled=False)
    done = 0
    try:
        with model.join(throw_on_early_termination=True):
            for x, y in my_batches(ctx):
                train_step(model, opt, x, y, quiet)
                done += 1
    except RuntimeError as err:
        return f"raised after {done} steps: {err}"
    return f"finished all {done} steps"
# --8<-- [end:throw]


def join_collectives_per_step(ctx) -> dict:
    """What Join costs while every rank still has data: the collectives of one step."""
    counts = {}
    for name in ("without_join", "with_join"):
        model = small_model(ctx)
        opt = sgd(model)
        x, y = my_batches(ctx)[0]
        quiet = timeline.Timeline(ctx.rank, enabled=False)

        def step(model=model, opt=opt, x=x, y=y, quiet=quiet):
            return train_step(model, opt, x, y, quiet)
        for _ in range(3):
            step()
        if name == "with_join":
            with Join([model]):
                counts[name] = stragglers.count_collectives(step)
        else:
            counts[name] = stragglers.count_collectives(step)
    return counts


def replicas_equal(model: nn.Module) -> float:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rank0 = flat.clone()
    dist.broadcast(rank0, src=0)
    return slowest_rank((flat - rank0).abs().max().item())


def sampler_counts(world_size: int) -> dict:
    """DistributedSampler makes the shards even: by repeating samples, or by dropping them."""
    counts = {}
    for drop_last in (False, True):
        shards = [list(DistributedSampler(range(DATASET_SIZE), num_replicas=world_size,
                                          rank=r, shuffle=True, seed=0, drop_last=drop_last))
                  for r in range(world_size)]
        seen = [i for shard in shards for i in shard]
        counts["drop_last" if drop_last else "padded"] = {
            "samples_per_rank": [len(s) for s in shards],
            "batches_per_rank": [-(-len(s) // BATCH) for s in shards],
            "repeated_samples": len(seen) - len(set(seen)),
            "dropped_samples": DATASET_SIZE - len(set(seen)),
        }
    return counts


def uneven_inputs(ctx) -> dict:
    tl = timeline.Timeline(ctx.rank, device=ctx.device)
    model = small_model(ctx)
    dist.barrier()
    tl.start_clock()
    batches = train_with_join(ctx, model, tl)
    events = timeline.gather_events(tl)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, {"batches": batches,
                                      "throw": train_with_join_that_throws(ctx)})
    return {"events": events, "batches_per_rank": [e["batches"] for e in everyone],
            "join_max_abs_diff_params": replicas_equal(model),
            "throw_on_early_termination": [e["throw"] for e in everyone],
            "sampler": sampler_counts(ctx.world_size)}


# --- 5. the two hangs (each its own short job) ---------------------------------------------------

# --8<-- [start:rank0_trap]
def evaluate_averaged(model: nn.Module, batches) -> float:
    """An evaluation written for *all* ranks: it averages the metric over them."""
    with torch.no_grad():
        loss = torch.stack([F.cross_entropy(model(x), y) for x, y in batches]).mean()
    dist.all_reduce(loss)          # every rank of the group must call this
    return loss.item() / dist.get_world_size()


def rank0_only_collective(ctx, args) -> None:
    """The trap: the evaluation runs on rank 0 only, but it contains a collective."""
    model, batches = small_model(ctx), my_batches(ctx)
    opt = sgd(model)
    quiet = timeline.Timeline(ctx.rank, enabled=False)
    for epoch in range(3):
        for x, y in batches[:4]:
            train_step(model, opt, x, y, quiet)
        if ctx.rank == 0:
            val = evaluate_averaged(model.module, batches[:2])  # waits for the others...
            print(f"epoch {epoch}: validation loss {val:.3f}")
        dist.barrier()  # ...who wait here for rank 0: neither collective can ever complete
# --8<-- [end:rank0_trap]


# --8<-- [start:no_join]
def uneven_without_join(ctx, args) -> None:
    """Uneven batches, no Join: the rank with fewer batches reaches the barrier before the
    final save while the other waits for it in the gradient all-reduce of its extra step."""
    model = small_model(ctx)
    opt = sgd(model)
    quiet = timeline.Timeline(ctx.rank, enabled=False)
    for x, y in my_batches(ctx):
        train_step(model, opt, x, y, quiet)
    dist.barrier()  # everyone done before rank 0 saves the model
    if ctx.rank == 0:
        torch.save(model.module.state_dict(), io.BytesIO())
# --8<-- [end:no_join]


HANG_DEMOS = {"rank0_only_collective": rank0_only_collective,
              "uneven_without_join": uneven_without_join}


# --- the worker --------------------------------------------------------------------------------

def worker(ctx: ddplab.RankContext, args) -> dict | None:
    quick = ctx.quick
    steps = 8 if quick else 25
    rounds = 15 if quick else 60
    slow_rank = args.slow_rank if args.slow_rank is not None else ctx.world_size - 1
    late = BUBBLE_DELAY_MS if ctx.rank == slow_rank else 0.0
    result = {"timelines": {kind: mlp_timeline(ctx, kind, steps=3)
                            for kind in ("native", "bucketed")},
              "bubble": mlp_timeline(ctx, "native", steps=2, late_ms=late),
              "sweeps": {kind: straggler_sweep(ctx, kind, args.delays, slow_rank, steps)
                         for kind in ("native", "bucketed")},
              "hook": hook_cost(ctx, rounds),
              "metric": metric_reduction(ctx, rounds),
              "syncbn": batchnorm_vs_syncbn(ctx, max(6, rounds // 2), train_step),
              "syncbn_timeline": syncbn_timeline(ctx, late, train_step),
              "join_collectives": join_collectives_per_step(ctx),
              "rank0_work": rank0_work(ctx),
              "uneven": uneven_inputs(ctx),
              "slow_rank": slow_rank}
    traces = chapter06_workbench.profiler_traces(ctx, train_step)  # GPU only: torch.profiler's view
    if traces is not None:
        result["profiler_traces"] = traces
    return result if ctx.is_main else None


# --- command line, and the files (drawing: scripts/drawing/chapter06.py) ----------------------
# flags, results.json and the summary: scripts/backstage/chapter06_report.py.

def parse_args(argv: list[str] | None = None):
    parser = ddplab.chapter_parser(__doc__, prog="chapter06_bubbles.py")
    parser.add_argument("--delays", default=None, metavar="MS,MS,...",
                        help="delays to inject on the late rank, in ms (default: "
                             f"{','.join(map(str, DELAYS['full']))}; with --quick "
                             f"{','.join(map(str, DELAYS['quick']))})")
    parser.add_argument("--slow-rank", type=int, default=None, metavar="R",
                        help="which rank is late (default: the last one)")
    return report.checked_args(ddplab.parse_chapter_args(parser, argv), DELAYS)


def finish(args, run: ddplab.Run) -> dict:
    """results.json from rank 0's result and the two hang demonstrations (their own jobs)."""
    hung = {name: hangs.run_hang_demo(demo, args, HANG_TIMEOUT_S)
            for name, demo in HANG_DEMOS.items()}
    return report.chapter_metrics(run.result, hung, args.delays, run.provenance,
                                  list(chapter06_workbench.traces(run.result)), EXPECTED_SLOPE,
                                  BUBBLE_DELAY_MS)


def wrote(folder, figures: list[str], traces: list[str]) -> str:
    return (f"wrote {folder}/ ({len(figures)} figures, {len(traces)} traces, results.json); "
            "open the traces at https://ui.perfetto.dev")


def main(argv: list[str] | None = None) -> dict | None:
    return run_chapter(CHAPTER, parse_args(argv), worker, finish=finish,
                       draw=drawing.chapter06.draw,
                       extras=lambda folder, metrics, run: chapter06_workbench.write_traces(
                           folder, run.result),
                       summarize=lambda metrics, run: report.summarize(metrics, EXPECTED_SLOPE),
                       wrote=wrote)


if __name__ == "__main__":
    sys.exit(ddplab.run_main(main))

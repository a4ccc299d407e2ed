"""Chapter 05 — data-parallel training: NaiveDDP, BucketedDDP and native DDP, side by side.

One training task; three implementations of data parallelism and a single process as the
reference.  The script trains them in lockstep from the same start on the same data and prints
how far apart their parameters end up (0 means bit for bit); times one training step of each
(interleaved, warm-up skipped) and measures peak memory per rank; shows how the data is sharded;
and measures throughput with 1, 2 and 4 ranks (1 … all GPUs on a GPU box).

The data set is generated, not downloaded: see ``make_task`` for the recipe.

Run it:
    make run-chapter05                                  # runs the next line
    python scripts/chapter05_data_parallel.py           # 2 CPU ranks, or one rank per GPU
    python scripts/chapter05_data_parallel.py --quick   # under a minute on a 2-core laptop
    torchrun --standalone --nproc-per-node 2 scripts/chapter05_data_parallel.py  # no scaling sweep
    python scripts/chapter05_data_parallel.py --size large   # a bigger model, for GPU throughput
    python scripts/chapter05_data_parallel.py --replot  # only redraw the figures

Writes out/chapter05/{equivalence.png, speed.png, scaling.png, sharding.png, results.json}
(or under --out DIR); the figures are drawn from results.json alone (scripts/drawing/chapter05.py).
"""

from __future__ import annotations

import copy
import statistics
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddplab
import drawing.chapter05
from backstage import chapter05_report as report
from backstage.chapter05_timing import rank_batches, time_variants, why_naive_is_slower
from ddplab import BucketedDDP, NaiveDDP
from ddplab.run.chapter_main import run_chapter
from ddplab.run.cli import with_changes
from ddplab.run.memory import PeakMemory
from ddplab.run.models import ResidualMLP, make_clusters, sgd
from ddplab.run.ranks import max_over_ranks, mean_over_ranks, native_ddp
from ddplab.run.world_size_sweep import sweep_world_sizes

CHAPTER = 5
VARIANTS = ("local", "naive", "bucketed", "native")


@dataclass(frozen=True)
class Size:
    features: int
    width: int
    hidden: int
    blocks: int
    classes: int
    batch: int          # samples per rank per step
    train: int          # training samples (the --quick run uses an eighth)
    test: int


SIZES = {
    # Small enough for a laptop CPU; 2.1 M parameters (8 MiB of gradients) in 30 tensors.
    "default": Size(features=64, width=256, hidden=1024, blocks=4, classes=10, batch=128,
                    train=16384, test=4096),
    # For GPU boxes: 67 M parameters, compute-heavy enough for GPUs to show their throughput.
    "large": Size(features=256, width=1024, hidden=4096, blocks=8, classes=100, batch=256,
                  train=65536, test=8192),
}
LR, MOMENTUM, EPOCHS = 0.05, 0.9, 2


DATA_SEED = 5  # the task is fixed; --seed changes the model's initialisation, not the data


def make_task(size: Size, quick: bool) -> tuple[TensorDataset, TensorDataset]:
    """Training and test sets from one draw of ``make_clusters`` (so they share the centres)."""
    n_train = size.train // 8 if quick else size.train
    x, y = make_clusters(n_train + size.test, size.features, size.classes, seed=DATA_SEED)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def build_model(size: Size) -> nn.Module:
    return ResidualMLP(size.features, size.width, size.hidden, size.blocks, size.classes)


# --- the three wrappers, and one training step for all of them -------------------------------

# --8<-- [start:wrap]
def wrap(kind: str, model: nn.Module, ctx: ddplab.RankContext, bucket_cap_mb: float | None):
    """The same model, made data-parallel three ways (or not at all: ``local``)."""
    if kind == "local":
        return model  # every rank trains alone: the cost of a step without communication
    if kind == "naive":
        return NaiveDDP(model)
    if kind == "bucketed":
        return BucketedDDP(model, bucket_cap_mb=bucket_cap_mb)
    # torch's DistributedDataParallel, told this rank's GPU (device_ids) when it has one
    return native_ddp(model, ctx, bucket_cap_mb=bucket_cap_mb,
                      gradient_as_bucket_view=kind == "native_view")
# --8<-- [end:wrap]


# --8<-- [start:step]
def train_step(model, optimizer, x, y) -> torch.Tensor:
    """One step, the same for every variant; only NaiveDDP needs the extra call."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()                  # BucketedDDP and native DDP average the gradients in here
    if isinstance(model, NaiveDDP):
        model.sync_gradients()       # NaiveDDP: afterwards, one parameter at a time
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
# --8<-- [end:step]


# --8<-- [start:accumulate]
def accumulation_step(model, optimizer, x, y, micro_batches: int) -> torch.Tensor:
    """The same step computed from smaller pieces: gradients add up locally in ``param.grad``,
    and only the last micro-batch's backward communicates."""
    total = torch.zeros((), device=x.device)
    pieces = zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True)
    for i, (x_micro, y_micro) in enumerate(pieces):
        last = i == micro_batches - 1
        with nullcontext() if last else model.no_sync():
            loss = F.cross_entropy(model(x_micro), y_micro) / micro_batches  # equal pieces
            loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total
# --8<-- [end:accumulate]


@torch.no_grad()
def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest |a − b| over all parameters: 0.0 means bit-for-bit equal."""
    return max((p - q).abs().max().item() for p, q in
               zip(a.parameters(), b.parameters(), strict=True))


# --- 1. same numbers: train every variant in lockstep ---------------------------------------

# --8<-- [start:shards]
def shard_loaders(train_set, ctx: ddplab.RankContext, batch: int):
    """One DataLoader per rank over its shard, built on every rank: this rank trains on its own,
    and rank 0 also reads the others' (the global batch, for the single-process reference)."""
    samplers = [DistributedSampler(train_set, num_replicas=ctx.world_size, rank=r,
                                   shuffle=True, seed=ctx.seed, drop_last=True)
                for r in range(ctx.world_size)]
    loaders = [DataLoader(train_set, batch_size=batch, sampler=s, drop_last=True)
               for s in samplers]
    return samplers, loaders


def epochs_of_batches(samplers, loaders):
    """Every rank's batch of each step, epoch after epoch."""
    for epoch in range(EPOCHS):
        for sampler in samplers:
            sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        yield from zip(*loaders, strict=True)
# --8<-- [end:shards]


def train_side_by_side(ctx, args, model: nn.Module, train_set, test_set) -> dict:
    size = SIZES[args.size]
    variants = {kind: wrap(kind, copy.deepcopy(model), ctx, args.bucket_cap_mb)
                for kind in ("native", "naive", "bucketed")}
    variants["no_sync"] = wrap("bucketed", copy.deepcopy(model), ctx, args.bucket_cap_mb)
    single = copy.deepcopy(model) if ctx.is_main else None  # the reference: no communication
    optimizers = {kind: sgd(m, LR, MOMENTUM) for kind, m in variants.items()}
    single_opt = sgd(single, LR, MOMENTUM) if single is not None else None

    samplers, loaders = shard_loaders(train_set, ctx, size.batch)
    losses = {kind: [] for kind in [*variants, "single"]}
    diffs = []  # per step: naive, bucketed, single process vs native; no_sync vs bucketed
    steps = EPOCHS * len(loaders[0])
    for batches in ddplab.progress(epochs_of_batches(samplers, loaders), ctx,
                                   "training 4 variants + 1 process in lockstep", total=steps):
        x, y = (t.to(ctx.device) for t in batches[ctx.rank])
        for kind in ("native", "naive", "bucketed"):
            losses[kind].append(train_step(variants[kind], optimizers[kind], x, y))
        losses["no_sync"].append(accumulation_step(variants["no_sync"], optimizers["no_sync"],
                                                   x, y, args.micro_batches))
        if single is not None:  # the global batch: every rank's batch, in rank order
            xg = torch.cat([b[0] for b in batches]).to(ctx.device)
            yg = torch.cat([b[1] for b in batches]).to(ctx.device)
            losses["single"].append(train_step(single, single_opt, xg, yg))
        native = variants["native"].module
        diffs.append([max_abs_diff(variants["naive"].module, native),
                      max_abs_diff(variants["bucketed"].module, native),
                      max_abs_diff(single, native) if single is not None else 0.0,
                      max_abs_diff(variants["no_sync"].module, variants["bucketed"].module)])
    diffs = max_over_ranks(torch.tensor(diffs, dtype=torch.float64))
    curves = {kind: mean_over_ranks(torch.stack(v).double()).tolist()
              for kind, v in losses.items() if kind != "single"}
    final = diffs[-1].tolist()
    return {
        "equivalence": {"naive_vs_native": final[0], "bucketed_vs_native": final[1],
                        "ddp_vs_single_process": final[2], "no_sync_vs_large_batch": final[3]},
        "training": {
            "steps": steps, "epochs": EPOCHS, "global_batch": size.batch * ctx.world_size,
            "micro_batches": args.micro_batches, "lr": LR, "momentum": MOMENTUM,
            "train_samples": len(train_set), "test_samples": len(test_set),
            "test_accuracy": accuracy(variants["native"].module, test_set, ctx.device),
            "test_accuracy_single_process":
                accuracy(single, test_set, ctx.device) if single is not None else None,
            "loss": {**curves, "single": [v.item() for v in losses["single"]]},
            "max_abs_diff_per_step": {
                name: diffs[:, i].tolist() for i, name in
                enumerate(("naive_vs_native", "bucketed_vs_native", "ddp_vs_single_process",
                           "no_sync_vs_large_batch"))},
        },
    }


@torch.no_grad()
def accuracy(model: nn.Module, dataset: TensorDataset, device: torch.device) -> float:
    model.eval()
    x, y = (t.to(device) for t in dataset.tensors)
    correct = sum((model(xb).argmax(1) == yb).sum().item()
                  for xb, yb in zip(x.split(1024), y.split(1024), strict=True))
    model.train()
    return correct / len(y)


# --- 2. speed and memory ---------------------------------------------------------------------
# Timing the variants side by side, fairly: scripts/backstage/chapter05_timing.py.

def stepper(model, batches):
    """A zero-argument step for ``timing.compare`` that cycles through ``batches``."""
    optimizer = sgd(model, LR, MOMENTUM)
    state = {"i": 0}

    def step():
        x, y = batches[state["i"] % len(batches)]
        state["i"] += 1
        train_step(model, optimizer, x, y)
    return step


def measure_speed(ctx, args, model: nn.Module, train_set) -> dict:
    size = SIZES[args.size]
    rounds = 12 if ctx.quick else 150
    batches = rank_batches(train_set, ctx, size.batch, count=8)
    models = {kind: wrap(kind, copy.deepcopy(model), ctx, args.bucket_cap_mb) for kind in VARIANTS}
    per_round, info = time_variants(ctx, models, batches, stepper, rounds,
                                    "timing local / naive / bucketed / native")
    median = {k: statistics.median(v) for k, v in per_round.items()}
    # Paired ratios: each round's step against native's step of the same round, then the median.
    ratio = {k: statistics.median(a / b for a, b in zip(per_round[k], per_round["native"],
                                                         strict=True))
             for k in ("naive", "bucketed", "local")}
    return {
        "step_time_ms": median,
        "ratio_to_native": ratio,
        "step_time_quartiles_ms": {k: statistics.quantiles(v, n=4)[::2]
                                   for k, v in per_round.items()},
        "timing": {"rounds": rounds, "warmup_steps": 3, "per_rank_batch": size.batch,
                   "bucket_cap_mb": args.bucket_cap_mb},
        "why_naive_is_slower": why_naive_is_slower(ctx, info, model),
    }


MEMORY_VARIANTS = (*VARIANTS, "native_view")  # native_view: gradient_as_bucket_view=True
SETUP_STEPS, STEADY_STEPS = 2, 3  # native rebuilds its buckets in the 2nd step's forward


def memory_worker(ctx: ddplab.RankContext, args) -> dict | None:
    """Peak memory each variant adds on this rank, in two phases, both above the level before
    the variant was built: *setup* (wrapping, and the first two steps, which include native
    DDP's bucket rebuild) and *steady state* (the steps after it, with the high-water mark
    reset, so setup's temporary copies do not count).  RSS on CPU, allocator peak on GPU.

    Each variant runs in a process of its own (``args.memory_variants`` holds one), so that no
    variant inherits the allocator's state, cached blocks or heap, from another; --quick runs
    them all in one process to save launches, each after the previous one was freed.
    """
    size = SIZES[args.size]
    train_set, _ = make_task(size, ctx.quick)
    torch.manual_seed(ctx.seed)
    model = build_model(size).to(ctx.device)
    batches = rank_batches(train_set, ctx, size.batch, count=STEADY_STEPS)
    warm_up = stepper(wrap("naive", copy.deepcopy(model), ctx, None), batches)
    warm_up()  # one-off allocations (thread pools, autograd engine, gloo) outside the figures
    del warm_up
    peaks = []
    for kind in args.memory_variants:
        with PeakMemory(ctx.device) as setup:
            wrapped = wrap(kind, copy.deepcopy(model), ctx, args.bucket_cap_mb)
            step = stepper(wrapped, batches)
            for _ in range(SETUP_STEPS):
                step()
        with PeakMemory(ctx.device, since=setup) as steady:  # above the same baseline
            for _ in range(STEADY_STEPS):
                step()
        del step, wrapped
        peaks += [setup.mib, steady.mib]
    if any(v is None for v in peaks):
        return None
    worst = max_over_ranks(torch.tensor(peaks, dtype=torch.float64)).tolist()
    if not ctx.is_main:
        return None
    return {kind: {"setup": worst[2 * i], "steady": worst[2 * i + 1]}
            for i, kind in enumerate(args.memory_variants)}


def measure_memory(args, main_run: ddplab.Run, main_result: dict) -> dict:
    """Launch ``memory_worker``: one fresh process group per variant (all in one with --quick;
    under torchrun, which cannot start new processes, the main run measured them in-process)."""
    fresh = not args.quick and main_run.provenance["launcher"] != "torchrun"
    peaks = main_result.pop("memory_in_process", None) or {}
    if main_run.provenance["launcher"] != "torchrun":
        for kinds in [(kind,) for kind in MEMORY_VARIANTS] if fresh else [MEMORY_VARIANTS]:
            sub = with_changes(args, memory_variants=kinds)
            peaks.update(ddplab.launch(memory_worker, sub).result or {})
    if set(peaks) != set(MEMORY_VARIANTS):  # no RSS high-water mark here (not Linux)
        return {"peak_memory_mb": None}
    return report.memory_results(peaks, SETUP_STEPS, STEADY_STEPS, fresh)


def worker(ctx: ddplab.RankContext, args) -> dict | None:
    """Runs on every rank."""
    size = SIZES[args.size]
    train_set, test_set = make_task(size, ctx.quick)
    torch.manual_seed(ctx.seed)  # the same initial model on every rank
    model = build_model(size).to(ctx.device)
    result = {"model": {"name": "ResidualMLP", **asdict(size),
                        "parameters": sum(p.numel() for p in model.parameters()),
                        "parameter_tensors": len(list(model.parameters()))}}
    result.update(train_side_by_side(ctx, args, model, train_set, test_set))
    result.update(measure_speed(ctx, args, model, train_set))
    if ctx.launcher == "torchrun":  # the processes are the ranks: measure memory in them
        del model
        result["memory_in_process"] = memory_worker(
            ctx, with_changes(args, memory_variants=MEMORY_VARIANTS))
    return result if ctx.is_main else None


# --- 3. throughput against world size (one launch per world size) ---------------------------

SWEPT = ("local", "bucketed", "native")


def throughput_worker(ctx: ddplab.RankContext, args) -> dict | None:
    if ctx.device.type == "cpu":
        torch.set_num_threads(1)  # one core per rank, as one GPU per rank: a rank is a worker
    size = SIZES[args.size]
    train_set, _ = make_task(size, ctx.quick)
    torch.manual_seed(ctx.seed)
    model = build_model(size).to(ctx.device)
    batches = rank_batches(train_set, ctx, size.batch, count=4)
    models = {kind: wrap(kind, copy.deepcopy(model), ctx, args.bucket_cap_mb) for kind in SWEPT}
    per_round, _ = time_variants(ctx, models, batches, stepper,
                                 rounds=6 if ctx.quick else 30,
                                 desc=f"throughput with {ctx.world_size} rank(s)")
    return {k: statistics.median(v) for k, v in per_round.items()} if ctx.is_main else None


# --- 4. sharding: which rank sees which sample (no processes needed) -------------------------

# --8<-- [start:sharding]
def shard_indices(n: int, world_size: int, how: str, epoch: int = 0, set_epoch: bool = True):
    """Sample indices each rank gets from a data set of ``n`` samples."""
    if how == "manual":  # the tutorials' way: contiguous slices, the remainder silently dropped
        per_rank = n // world_size
        return [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(world_size)]
    shards = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank,
                                     shuffle=how == "shuffled", seed=0,
                                     drop_last=how == "drop_last")
        if set_epoch:
            sampler.set_epoch(epoch)  # forget this and every epoch has the same order
        shards.append(list(sampler))
    return shards
# --8<-- [end:sharding]


def sharding_demo() -> dict:
    n, world, epochs = 10, 3, 3
    schemes = {how: shard_indices(n, world, how) for how in ("manual", "padded", "drop_last")}
    seen = {how: [i for shard in s for i in shard] for how, s in schemes.items()}
    orders = {flag: [shard_indices(12, 2, "shuffled", epoch, set_epoch=flag)[0]
                     for epoch in range(epochs)] for flag in (True, False)}
    return {
        "samples": n, "world_size": world, "shards": schemes,
        "never_seen": {how: sorted(set(range(n)) - set(s)) for how, s in seen.items()},
        "seen_twice": {how: sorted({i for i in s if s.count(i) > 1}) for how, s in seen.items()},
        "rank0_order_by_epoch": {"with_set_epoch": orders[True],
                                 "without_set_epoch": orders[False]},
        "orders_repeat_without_set_epoch": all(o == orders[False][0] for o in orders[False]),
    }


# --- the launching process (the summary: backstage/chapter05_report.py; the figures:
# scripts/drawing/chapter05.py) -------------------------------------------------------------------

def parse_args(argv: list[str] | None = None):
    parser = ddplab.chapter_parser(__doc__, prog="chapter05_data_parallel.py")
    parser.add_argument("--size", choices=sorted(SIZES), default="default",
                        help="model and batch size: default (laptop CPU) or large (GPUs)")
    parser.add_argument("--bucket-cap-mb", type=ddplab.positive(float), default=4.0, metavar="MIB",
                        help="bucket size of BucketedDDP and native DDP (default: 4 MiB, which "
                             "gives the default model three buckets)")
    parser.add_argument("--micro-batches", type=ddplab.positive(int), default=4, metavar="K",
                        help="gradient accumulation: no_sync over K micro-batches (default: 4)")
    args = ddplab.parse_chapter_args(parser, argv)
    if SIZES[args.size].batch % args.micro_batches:
        raise ddplab.UsageError(f"--micro-batches must divide the per-rank batch "
                                f"({SIZES[args.size].batch})")
    return args


def finish(args, run: ddplab.Run) -> dict:
    """Rank 0's result, then the runs it needs apart: memory, the world-size sweep."""
    result = run.result
    result.update(measure_memory(args, run, result))
    result["scaling"] = sweep_world_sizes(args, run, result, throughput_worker, SWEPT,
                                          SIZES[args.size].batch)
    result["sharding"] = sharding_demo()
    result["verdicts"] = report.verdicts(result)  # the page's comparisons, computed
    return result


def main(argv: list[str] | None = None) -> dict | None:
    return run_chapter(CHAPTER, parse_args(argv), worker, finish=finish,
                       draw=drawing.chapter05.draw,
                       summarize=lambda result, run: report.summarize(
                           result, run.provenance, VARIANTS, MEMORY_VARIANTS))


if __name__ == "__main__":
    sys.exit(ddplab.run_main(main))

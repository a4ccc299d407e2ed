"""Chapter 11 — sharding: the memory ledger, ZeRO-1/2 and FSDP by hand next to the native ones.

One small model, six ways to train it: DDP, ZeRO-1 (ours and ZeroRedundancyOptimizer), ZeRO-2
(ours), FSDP (ours and fully_shard).  Every byte a rank holds, against the formula; ours and
native in lockstep (0 means bit for bit), at this world size and again at 3 ranks, with the
first element the flat layout sums in another order; bytes per step and a per-layer timeline;
chapter 03's ring in halves; gradient accumulation under sharding; a checkpoint saved at 2
ranks, continued at 3; and when FSDP's all-gathers hide behind compute (chapter 10's cost
model).

Run it:
    make run-chapter11                                  # runs the next line
    python scripts/chapter11_sharding.py                # 2 CPU ranks, or one rank per GPU
    python scripts/chapter11_sharding.py --quick        # under a minute on a 2-core laptop
    python scripts/chapter11_sharding.py --world-size 3 # where the flat layout stops being bitwise
    torchrun --standalone --nproc-per-node 2 scripts/chapter11_sharding.py  # no 3-rank launch
    python scripts/chapter11_sharding.py --replot       # only redraw the figures

Writes out/chapter11/{ledger_formula.png, ledger.png, gathers.png, timeline.png, halves.png,
results.json} (or under --out DIR); the figures are drawn from results.json alone
(scripts/drawing/chapter11.py).
"""

from __future__ import annotations

import sys
import time
import warnings
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import ddplab
import drawing.chapter11
from backstage import chapter11_probe as probe
from backstage import chapter11_report as report
from ddplab import FullyShardedDP, ShardedOptimizer, costmodel
from ddplab import memory_ledger as ml
from ddplab.fsdp import clip_grad_norm_
from ddplab.fsdp_layout import (
    parameter_major,
    shard,
)
from ddplab.run.chapter_main import run_chapter
from ddplab.zero2 import ShardedGradients

CHAPTER = 11
# (features, first width, second width, classes, batch per rank); no width divides by 3.
SIZES = {"quick": (20, 250, 130, 10, 32), "full": (64, 1000, 700, 10, 64)}
LR, WEIGHT_DECAY = 1e-2, 0.1
STAGES = ("ddp", "zero1_ours", "zero1_native", "zero2", "fsdp_ours", "fully_shard")


def make_model(size) -> nn.Module:
    features, first, second, classes, _ = size
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, first), nn.ReLU(), nn.LayerNorm(first),
                         nn.Linear(first, second), nn.ReLU(), nn.Linear(second, classes))


def batches(ctx, size, steps: int, seed: int = 100):
    features, _, _, classes, batch = size
    g = torch.Generator().manual_seed(seed + ctx.rank)  # every rank its own data
    return [(torch.randn(batch, features, generator=g).to(ctx.device),
             torch.randint(0, classes, (batch,), generator=g).to(ctx.device))
            for _ in range(steps)]


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


# --8<-- [start:fully_shard]
def native_fsdp(module: nn.Module, device: torch.device, **kwargs) -> nn.Module:
    """``fully_shard`` on each layer with parameters, then on the root (FSDP2's recipe)."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # a CPU mesh works too
    for layer in module.children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, **kwargs)
    return fully_shard(module, mesh=mesh, **kwargs)
# --8<-- [end:fully_shard]


# --8<-- [start:build]
def build(stage: str, model: nn.Module, ctx):
    """The model trained one of six ways: (what to call, its optimizer, after each step)."""
    if stage == "zero2":
        wrapped = ShardedGradients(model)
        return wrapped, adamw(wrapped.shard_parameters()), wrapped.gather_parameters
    if stage in ("fsdp_ours", "fully_shard"):  # model.parameters() are this rank's shards
        wrapped = (FullyShardedDP(model) if stage == "fsdp_ours"
                   else native_fsdp(model, ctx.device))
        return wrapped, adamw(wrapped.parameters()), None
    gpu = [ctx.local_rank] if ctx.device.type == "cuda" else None
    wrapped = DistributedDataParallel(model, device_ids=gpu)
    if stage == "zero1_ours":
        optimizer = ShardedOptimizer(wrapped.parameters(), torch.optim.AdamW,
                                     lr=LR, weight_decay=WEIGHT_DECAY)
    elif stage == "zero1_native":
        optimizer = ZeroRedundancyOptimizer(wrapped.parameters(), torch.optim.AdamW,
                                            lr=LR, weight_decay=WEIGHT_DECAY)
    else:
        optimizer = adamw(wrapped.parameters())
    return wrapped, optimizer, None
# --8<-- [end:build]


def train(wrapped, optimizer, after, data) -> None:
    """A step per batch; the last step's gradients are left in place (the ledger counts them)."""
    for x, y in data:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(wrapped(x), y).backward()  # FSDP: gathers, reduce-scatters in here
        optimizer.step()
        if after is not None:
            after()  # ZeRO-2: every rank's updated shard to every rank


# --- 1. the ledger: every byte a rank holds, against the formula ------------------------------

def ledger(ctx, args) -> dict:
    """Per stage: bytes held after STEPS steps (measured, predicted) and the profiler's peak."""
    size = SIZES["quick" if ctx.quick else "full"]
    data = batches(ctx, size, 2)
    shapes = [tuple(p.shape) for p in make_model(size).parameters()]
    found = {}
    for stage in STAGES:
        keep = {}

        def work(stage=stage, keep=keep):  # the model built inside: its bytes count too
            keep["run"] = build(stage, make_model(size).to(ctx.device), ctx)
            train(*keep["run"], data)
        peak = probe.profiler_peak_bytes(work, ctx.device.type)
        held, predicted = probe.held_and_predicted(stage, *keep["run"][:2], shapes, ctx)
        found[stage] = {"held": vars(held) | {"total": held.total},
                        "predicted": vars(predicted) | {"total": predicted.total},
                        "profiler_peak": peak}
        del keep
    every = [None] * ctx.world_size
    dist.all_gather_object(every, found)
    numel = sum(torch.Size(s).numel() for s in shapes)
    return {"per_rank": every, "numel": numel, "shapes": shapes,
            "paper": {p: [vars(ml.paper_ledger(7.5e9, 64, s, p)) for s in range(4)]
                      for p in ml.PAPER_BYTES}}


# --- 2. the same numbers: ours against native, in lockstep ------------------------------------

def flat_average(grads, shapes, rank: int, world: int, group=None) -> list[torch.Tensor]:
    """The tempting mistake: a DDP bucket's flat parameter-major message, averaged, each rank
    keeping its rows.  The same sums, at other offsets of the message."""
    message = parameter_major(grads, world)
    dist.all_reduce(message, op=dist.ReduceOp.AVG, group=group)
    rows = [-(-s[0] // world) * world * s[1:].numel() for s in shapes]
    return [shard(t.view(-1, *s[1:])[:s[0]], rank, world)
            for t, s in zip(message.split(rows), shapes, strict=True)]


class FlatLayoutFSDP(FullyShardedDP):
    """FullyShardedDP with the flat layout's reduction (``flat_average``)."""

    def reduce_scatter(self, grads, shapes, group):
        return flat_average(grads, shapes, self.rank, self.world, group)


def equality(ctx, args) -> dict:
    size = SIZES["quick" if ctx.quick else "full"]
    data, warm = batches(ctx, size, args.steps), batches(ctx, size, 1, seed=77)[0]
    runs = {}
    for stage in (*STAGES, "fsdp_flat"):
        model = make_model(size).to(ctx.device)
        if stage == "fsdp_flat":
            runs[stage] = (w := FlatLayoutFSDP(model), adamw(w.parameters()), None)
        else:
            runs[stage] = build(stage, model, ctx)
        if isinstance(runs[stage][0], DistributedDataParallel):  # native DDP rebuilds its
            F.cross_entropy(runs[stage][0](warm[0]), warm[1]).backward()  # buckets in
            runs[stage][0].zero_grad(set_to_none=True)  # ready order: ZeRO-2's layout
        train(*runs[stage], data)
    ddp, zero1, native1 = (runs[s][0].module for s in ("ddp", "zero1_ours", "zero1_native"))
    diff = probe.max_diff

    def with_state(stage):  # this rank's shards and their AdamW state
        model, optimizer, _ = runs[stage]
        return [*model.parameters(), *probe.adam_state(model, optimizer)]
    ddp_shards = [shard(p.detach(), ctx.rank, ctx.world_size) for p in ddp.parameters()]
    first = probe.first_difference(make_model(size).to(ctx.device), batches(ctx, size, 1)[0],
                                   ctx, flat_average)
    return {"steps": args.steps, "world_size": ctx.world_size,
            "first_difference": first, "max_abs_diff": {
        "zero1_ours_vs_zero_redundancy": diff(zero1.parameters(), native1.parameters()),
        "zero1_ours_vs_ddp": diff(zero1.parameters(), ddp.parameters()),
        "zero2_ours_vs_ddp": diff(runs["zero2"][0].module.parameters(), ddp.parameters()),
        "fsdp_ours_vs_fully_shard": diff(with_state("fsdp_ours"), with_state("fully_shard")),
        "fully_shard_vs_ddp": diff(runs["fully_shard"][0].parameters(), ddp_shards),
        "flat_layout_vs_fully_shard": diff(with_state("fsdp_flat"), with_state("fully_shard"))}}


# --- 3. communication: bytes per step, a timeline, the ring's two halves ----------------------

def communication(ctx, args) -> dict:
    size = SIZES["quick" if ctx.quick else "full"]
    x, y = batches(ctx, size, 1)[0]
    measured = {}
    for stage in ("ddp", "fsdp_ours", "fully_shard"):
        wrapped, optimizer, after = build(stage, make_model(size).to(ctx.device), ctx)
        with probe.recorded_collectives() as calls:
            if stage == "ddp":
                wrapped.register_comm_hook(None, probe.ddp_recording_hook(calls))
            train(wrapped, optimizer, after, [(x, y)])
        by_op: dict[str, int] = {}
        for op, message in calls:
            by_op[op] = by_op.get(op, 0) + message
        measured[stage] = {"calls": len(calls), "messages": sum(by_op.values()), "by_op": by_op,
                           **report.sent_bytes(by_op, ctx.world_size)}
    numel = sum(p.numel() for p in make_model(size).parameters())
    counted = costmodel.zero3_bytes_per_step(numel * 4, ctx.world_size)
    return {"measured": measured, "counted": counted, "param_bytes": numel * 4,
            "timeline": timeline(ctx, size, x, y), "ring_halves": probe.ring_halves(ctx)}


def timeline(ctx, size, x, y) -> dict:
    """One step of FullyShardedDP after a warm-up step, its gathers and reduce-scatters timed."""
    model = FullyShardedDP(make_model(size).to(ctx.device))
    optimizer = adamw(model.parameters())
    train(model, optimizer, None, [(x, y)])
    names = [type(u.module).__name__ + f" {i}" for i, u in enumerate(model.units)]
    start = time.perf_counter()
    events = probe.record_timeline(model, names, start)
    loss = F.cross_entropy(model(x), y)
    backward_ms = (time.perf_counter() - start) * 1e3
    loss.backward()
    end_ms = (time.perf_counter() - start) * 1e3
    return {"events": events, "layers": names, "backward_starts_ms": backward_ms,
            "end_ms": end_ms, "rank": ctx.rank}


# --- 4. gradient accumulation under sharding, and clipping ------------------------------------

# --8<-- [start:accumulate]
def accumulate(model, optimizer, x, y, micro: int, sync_each: bool) -> None:
    """One step from ``micro`` pieces: reduce-scatter every piece, or keep full gradients
    unsharded and reduce-scatter once, in the last backward."""
    pieces = list(zip(x.chunk(micro), y.chunk(micro), strict=True))
    for i, (xm, ym) in enumerate(pieces):
        model.set_requires_gradient_sync(sync_each or i == micro - 1)
        loss = F.cross_entropy(model(xm), ym) / micro  # the mean over the whole batch
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
# --8<-- [end:accumulate]


def accumulation(ctx, args) -> dict:
    size = SIZES["quick" if ctx.quick else "full"]
    data = batches(ctx, size, 2)
    out, params = {}, {}
    for mode, sync_each in (("every_micro_batch", True), ("once_per_step", False)):
        pair = {}
        for kind in ("ours", "native"):
            model = make_model(size).to(ctx.device)
            model = FullyShardedDP(model) if kind == "ours" else native_fsdp(model, ctx.device)
            optimizer = adamw(model.parameters())
            x, y = data[0]
            peak = probe.profiler_peak_bytes(partial(accumulate, model, optimizer, x, y,
                                                     args.micro_batches, sync_each),
                                             ctx.device.type)
            one_step = dict(getattr(model, "bytes", {}))  # ours counts its messages
            for x, y in data[1:]:
                accumulate(model, optimizer, x, y, args.micro_batches, sync_each)
            pair[kind] = (model, optimizer, peak, one_step)
        (ours, ours_opt, peak, one_step), (theirs, theirs_opt, *_) = pair["ours"], pair["native"]
        params[mode] = [p.detach().clone() for p in ours.parameters()]
        out[mode] = {"bytes_per_step": one_step, "profiler_peak": peak,
                     "ours_vs_fully_shard": probe.max_diff(
                         [*ours.parameters(), *probe.adam_state(ours, ours_opt)],
                         [*theirs.parameters(), *probe.adam_state(theirs, theirs_opt)]),
                     "gradients_held": probe.gradients_held_before_last(
                         FullyShardedDP(make_model(size).to(ctx.device)), *data[0],
                         args.micro_batches, sync_each)}
    out["modes_differ_by"] = probe.max_diff(params["every_micro_batch"], params["once_per_step"])
    return {"micro_batches": args.micro_batches, **out, "clipping": clipping(ctx, size)}


def clipping(ctx, size) -> dict:
    """The global norm of the sharded gradients against clip_grad_norm_ on DDP's full ones."""
    x, y = batches(ctx, size, 1)[0]
    ours = FullyShardedDP(make_model(size).to(ctx.device))
    F.cross_entropy(ours(x), y).backward()
    ddp = DistributedDataParallel(make_model(size).to(ctx.device))
    F.cross_entropy(ddp(x), y).backward()
    full = torch.nn.utils.clip_grad_norm_(ddp.parameters(), float("inf")).item()
    local = torch.nn.utils.clip_grad_norm_(list(ours.parameters()), float("inf")).item()
    norm = clip_grad_norm_(list(ours.parameters()), float("inf")).item()
    every = [None] * ctx.world_size
    dist.all_gather_object(every, local)
    # Did the two norms see the same gradients?  If so, only their summation order differs.
    grads = probe.max_diff([p.grad for p in ours.parameters()],
                           [shard(p.grad, ctx.rank, ctx.world_size) for p in ddp.parameters()])
    return {"full_model_norm": full, "global_norm_of_shards": norm,
            "local_norm_per_rank": every, "global_rel_err": abs(norm - full) / full,
            "grads_max_abs_diff": grads}


# --- 5. a sharded checkpoint saved at 2 ranks, continued at 3 ---------------------------------

SAVED_STEPS, CONTINUED_STEPS = 3, 3


def dcp_save(ctx, args) -> dict | None:
    """fully_shard trained at this world size, saved twice: DCP's sharded checkpoint (every
    rank writes its shards) and, as the reference, the full state gathered to rank 0."""
    size = SIZES["quick" if ctx.quick else "full"]
    model = native_fsdp(make_model(size).to(ctx.device), ctx.device)
    optimizer = adamw(model.parameters())
    train(model, optimizer, None, batches(ctx, size, SAVED_STEPS))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.checkpoint / "dcp")
    full = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
    if ctx.is_main:
        torch.save(full, args.checkpoint / "full.pt")
    return {"world_size": ctx.world_size} if ctx.is_main else None


# --8<-- [start:dcp_load]
def load_resharded(model, optimizer, checkpoint) -> None:
    """A checkpoint saved at any world size, read into this one's shards: DCP reads the
    pieces of the saved shards that cover each rank's new shard."""
    model_sd, optim_sd = get_state_dict(model, optimizer)  # this world's shards, as targets
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
# --8<-- [end:dcp_load]


def dcp_continue(ctx, args) -> dict | None:
    """At this world size: fully_shard loaded from the DCP checkpoint (resharded) against
    fully_shard loaded from the full state; both continue on the same data."""
    size = SIZES["quick" if ctx.quick else "full"]

    def fresh():
        model = native_fsdp(make_model(size).to(ctx.device), ctx.device)
        return model, adamw(model.parameters())
    (a, a_opt), (b, b_opt), (c, c_opt) = fresh(), fresh(), fresh()
    load_resharded(a, a_opt, args.checkpoint / "dcp")
    model_full, optim_full = torch.load(args.checkpoint / "full.pt", weights_only=True)
    set_state_dict(b, b_opt, model_state_dict=model_full, optim_state_dict=optim_full,
                   options=StateDictOptions(full_state_dict=True))
    loaded = probe.max_diff([*a.parameters(), *probe.adam_state(a, a_opt)],
                      [*b.parameters(), *probe.adam_state(b, b_opt)])
    data = batches(ctx, size, CONTINUED_STEPS, seed=200)
    for model, optimizer in ((a, a_opt), (b, b_opt), (c, c_opt)):
        train(model, optimizer, None, data)
    out = {"world_size": ctx.world_size, "steps_saved": SAVED_STEPS,
           "steps_continued": CONTINUED_STEPS, "loaded_max_abs_diff": loaded,
           "local_rows_rank0": [ml.local(p).shape[0] for p in a.parameters()],
           "continued_max_abs_diff": probe.max_diff([*a.parameters(), *probe.adam_state(a, a_opt)],
                                              [*b.parameters(), *probe.adam_state(b, b_opt)]),
           "without_checkpoint_max_abs_diff": probe.max_diff(a.parameters(), c.parameters())}
    return out if ctx.is_main else None


def continue_and_compare(ctx, args) -> dict | None:
    """The 3-rank launch does two things: the DCP continuation, then the lockstep comparison
    again at 3 ranks, where the layouts change the bits."""
    out = dcp_continue(ctx, args)
    at_three = equality(ctx, args)
    return out | {"equality": at_three} if ctx.is_main else None


# --- the launching process --------------------------------------------------------------------

def worker(ctx: ddplab.RankContext, args) -> dict | None:
    # ShardedGradients calls the collectives torch 2.13 renamed (``*_single``): one warning
    # per rank and per call site that says nothing about this run.
    warnings.filterwarnings("ignore", r"`torch\.distributed\.(reduce_scatter_tensor|"
                            r"all_gather_into_tensor)` is deprecated", FutureWarning)
    size = SIZES["quick" if ctx.quick else "full"]
    numel = sum(p.numel() for p in make_model(size).parameters())
    result = {"model": {"sizes": size, "numel": numel}}
    result["ledger"] = ledger(ctx, args)
    result["equality"] = equality(ctx, args)
    result["communication"] = communication(ctx, args)
    result["accumulation"] = accumulation(ctx, args)
    return result if ctx.is_main else None


def parse_args(argv: list[str] | None = None):
    parser = ddplab.chapter_parser(__doc__, prog="chapter11_sharding.py")
    parser.add_argument("--steps", type=ddplab.positive(int), default=None, metavar="K",
                        help="training steps of the lockstep comparison (default: 3 with "
                             "--quick, else 8)")
    parser.add_argument("--micro-batches", type=ddplab.positive(int), default=4, metavar="K",
                        help="gradient accumulation: K micro-batches per step (default: 4)")
    args = ddplab.parse_chapter_args(parser, argv)
    args.steps = args.steps or (3 if args.quick else 8)
    batch = SIZES["quick" if args.quick else "full"][-1]
    if batch % args.micro_batches:
        raise ddplab.UsageError(f"--micro-batches must divide the per-rank batch ({batch})")
    return args


def finish(args, run: ddplab.Run) -> dict:
    """Rank 0's result, the 2 -> 3 reload (its own launches), the cost model and the verdicts."""
    result = run.result
    result["reshard"] = probe.save_then_continue(args, run, dcp_save, continue_and_compare)
    if "equality" in result["reshard"]:  # not under torchrun, which cannot start 3 ranks
        result["equality_3"] = result["reshard"].pop("equality")
    result["cost_model"] = report.cost_model(costmodel)
    result["verdicts"] = report.verdicts(result, run.provenance["backend"])
    return result


def main(argv: list[str] | None = None) -> dict | None:
    return run_chapter(CHAPTER, parse_args(argv), worker, finish=finish,
                       draw=drawing.chapter11.draw,
                       summarize=lambda result, run: report.summarize(result, run.provenance))


if __name__ == "__main__":
    sys.exit(ddplab.run_main(main))

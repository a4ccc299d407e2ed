"""Chapter 09 — mixed precision and compressed gradients: communication hooks on both DDPs.

One hook API for BucketedDDP and native DDP; the same hook on both gives the same bits.  Trains
the same model with no compression, fp16, bf16 and PowerSGD at 1, 2 and 4 ranks, counts the
bytes each hook hands to all-reduce, times each hook, and compares the time with what chapter
03's alpha-beta-gamma model predicts; then asks the model on which link compression pays.
Also: autocast with DDP (bf16 where the device has it, else fp16 + GradScaler), the scaler's
skip, and PowerSGD's error feedback after an overflow.

Run it:
    make run-chapter09                                   # runs the next line
    python scripts/chapter09_compression.py              # 2 CPU ranks (+ sweep over 1, 2, 4)
    python scripts/chapter09_compression.py --quick      # under a minute on a 2-core laptop
    torchrun --standalone --nproc-per-node 2 scripts/chapter09_compression.py  # no sweep
    python scripts/chapter09_compression.py --replot     # redraw the figures from results.json

Writes out/chapter09/{training.png, prediction.png, links.png, results.json}.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from argparse import Namespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

import ddplab
import drawing.chapter09
from ddplab import BucketedDDP
from ddplab.comm_hooks import HookBucket, bf16_hook, count_bytes, fp16_hook
from ddplab.costmodel import chapter03_calibration
from ddplab.hook_costmodel import prediction, where_it_pays
from ddplab.powersgd import PowerSGDState, powersgd_hook
from ddplab.precision import mixed_precision_for
from ddplab.run.chapter_main import run_chapter
from ddplab.run.models import ResidualMLP, make_clusters, sgd
from ddplab.run.ranks import max_over_ranks, native_ddp
from ddplab.run.world_size_sweep import launch_per_world_size

CHAPTER = 9
HOOKS = ("none", "fp16", "bf16", "powersgd")
RANK, START_ITER = 2, 10          # PowerSGD: rank 2 (Gram-Schmidt in both), compress from step 10
BATCH, LR, MOMENTUM, CAP_MB = 64, 0.02, 0.9, 4.0  # LR: see "Going deeper: a learning rate"
# torch's powerSGD_hook starts its P and Q all-reduces from future callbacks, on the thread that
# completed the previous one, while backward goes on starting the next bucket's hook: with
# several buckets, two ranks can issue collectives in different orders, and gloo aborts ("Received
# data size doesn't match expected size").  Compared with it, every model has one bucket.
ONE_BUCKET = 1024.0


def build_model() -> nn.Module:
    return ResidualMLP(features=64, width=256, hidden=1024, blocks=4, classes=10)  # 2.1 M


def make_hook(name: str, world: int):
    """(state, hook) for a hook name, or None for DDP's own averaging."""
    if name == "none":
        return None
    if name == "powersgd":
        return PowerSGDState(rank=RANK, start_iter=START_ITER), powersgd_hook
    return None, {"fp16": fp16_hook, "bf16": bf16_hook}[name]


# --8<-- [start:step]
def train_step(model, optimizer, x, y, scaler=None) -> torch.Tensor:
    """Forward under autocast (bf16, or fp16 where the GPU lacks it); weights and gradients
    stay fp32."""
    dtype = mixed_precision_for(x.device).dtype
    with torch.autocast(x.device.type, dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    if scaler is None:
        loss.backward()                # DDP averages the fp32 gradients in here
        optimizer.step()
    else:                              # fp16: scale the loss so small gradients do not flush
        scaler.scale(loss).backward()
        scaler.step(optimizer)         # skipped if any gradient is inf/NaN
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach().float()
# --8<-- [end:step]


def scaler_for(ctx):
    """fp16 needs a GradScaler; bf16 has float32's range and needs none."""
    return mixed_precision_for(ctx.device).scaler(ctx.device)


def wait_for_device(ctx) -> None:
    """On a GPU the host only queues kernels: finish them before reading the clock."""
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def batches(ctx, steps: int, data_seed: int = 5):
    """This rank's ``steps`` batches of a generated task (the same task for every hook)."""
    x, y = make_clusters(steps * BATCH * ctx.world_size + 2048, 64, 10, seed=data_seed)
    test = (x[-2048:].to(ctx.device), y[-2048:].to(ctx.device))
    per_step = BATCH * ctx.world_size
    out = [(x[s * per_step + ctx.rank * BATCH:s * per_step + (ctx.rank + 1) * BATCH],
            y[s * per_step + ctx.rank * BATCH:s * per_step + (ctx.rank + 1) * BATCH])
           for s in range(steps)]
    return [(a.to(ctx.device), b.to(ctx.device)) for a, b in out], test


@torch.no_grad()
def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(),
                                                          strict=True))


def slowest(value: float) -> float:
    """The largest value over the ranks (on nccl the tensor travels through this rank's GPU)."""
    return max_over_ranks(torch.tensor([value], dtype=torch.float64)).item()


# --- 1. the same hook on both DDPs ---------------------------------------------------------

def same_hook_on_both(ctx, model, data, state_and_hook, steps: int, cap_mb: float) -> float:
    """Train BucketedDDP and native DDP with the same hook; the largest parameter difference."""
    ours = BucketedDDP(copy.deepcopy(model), bucket_cap_mb=cap_mb)
    theirs = native_ddp(copy.deepcopy(model), ctx, bucket_cap_mb=cap_mb)
    for ddp in (ours, theirs):
        state, hook = state_and_hook()   # a fresh state for each: PowerSGD's is per model
        ddp.register_comm_hook(state, hook)
    opts = [sgd(ours, LR, MOMENTUM), sgd(theirs, LR, MOMENTUM)]
    scalers = [scaler_for(ctx), scaler_for(ctx)]
    for x, y in data[:steps]:
        for ddp, opt, scaler in zip((ours, theirs), opts, scalers, strict=True):
            train_step(ddp, opt, x, y, scaler)
    return slowest(max_abs_diff(ours.module, theirs.module))


def torch_bf16_renamed(process_group, bucket):
    """torch's bf16_compress_hook, unchanged, under another name: native DDP refuses that name
    without CUDA and NCCL (distributed.py ``_check_comm_hook``), although gloo sums bfloat16."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


def equivalence(ctx, model, data, steps: int) -> dict:
    fresh = lambda s, h: (lambda: (s() if callable(s) else s, h))  # noqa: E731
    cases = {
        "torch_allreduce_hook": fresh(None, default_hooks.allreduce_hook),
        "torch_fp16_compress_hook": fresh(None, default_hooks.fp16_compress_hook),
        "torch_bf16_compress_hook": fresh(None, torch_bf16_renamed),
        "our_fp16_hook": fresh(None, fp16_hook), "our_bf16_hook": fresh(None, bf16_hook),
        "our_powersgd": fresh(lambda: PowerSGDState(rank=RANK, start_iter=2), powersgd_hook),
        "torch_powersgd": fresh(lambda: torch_powersgd.PowerSGDState(
            None, matrix_approximation_rank=RANK, start_powerSGD_iter=2,
            min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0),
            torch_powersgd.powerSGD_hook),
    }
    out = {f"{name}_bucketed_vs_native": same_hook_on_both(
        ctx, model, data, make, steps, ONE_BUCKET if "powersgd" in name else CAP_MB)
        for name, make in cases.items()}
    # Ours against torch's PowerSGD, both on native DDP: the algorithm, not the wrapper.
    a, b = (native_ddp(copy.deepcopy(model), ctx, bucket_cap_mb=ONE_BUCKET) for _ in range(2))
    a.register_comm_hook(PowerSGDState(rank=RANK, start_iter=2), powersgd_hook)
    b.register_comm_hook(cases["torch_powersgd"]()[0], torch_powersgd.powerSGD_hook)
    opts = [sgd(a, LR, MOMENTUM), sgd(b, LR, MOMENTUM)]
    for x, y in data[:steps]:
        for ddp, opt in zip((a, b), opts, strict=True):
            train_step(ddp, opt, x, y)
    out["our_powersgd_vs_torch_powersgd"] = slowest(max_abs_diff(a.module, b.module))
    # No hook, under autocast: BucketedDDP against native.
    out["autocast_bucketed_vs_native"] = same_hook_on_both(
        ctx, model, data, lambda: (None, default_hooks.allreduce_hook), steps, CAP_MB)
    out["steps"] = steps
    return out


# --- 2. the scaler's skip, across ranks ------------------------------------------------------

# --8<-- [start:skip]
def scaler_skip(ctx, model, data) -> dict:
    """Rank 1 alone gets an inf in its batch.  With DDP every rank skips the step; without
    averaging, only rank 1 would, and the replicas would drift apart."""
    x, y = data[0]
    x = x.clone()
    if ctx.rank == 1:
        x[0, 0] = float("inf")
    result = {}
    for name, net in (("ddp", BucketedDDP(copy.deepcopy(model), bucket_cap_mb=CAP_MB)),
                      ("local", copy.deepcopy(model))):
        scaler = torch.amp.GradScaler(ctx.device.type, init_scale=2.0**16)
        train_step(net, sgd(net, LR, MOMENTUM), x, y, scaler)
        skipped = scaler.get_scale() < 2.0**16          # update() halves the scale on a skip
        flags = [None] * ctx.world_size
        dist.all_gather_object(flags, bool(skipped))
        result[name] = flags
    return result
# --8<-- [end:skip]


# --8<-- [start:recovery]
def overflow_recovery(ctx, model, data, make_hook, overflow_at: int = 5) -> list[bool]:
    """PowerSGD from step 2, a GradScaler, and at step ``overflow_at`` one inf in rank 1's
    batch: which steps the scaler skipped (the same list on every rank)."""
    ddp = native_ddp(copy.deepcopy(model), ctx, bucket_cap_mb=ONE_BUCKET)
    ddp.register_comm_hook(*make_hook())
    opt, scaler, skipped = sgd(ddp, LR, MOMENTUM), torch.amp.GradScaler(ctx.device.type), []
    for step, (x, y) in enumerate(data[:overflow_at + 8]):
        if step == overflow_at and ctx.rank == 1:
            x = x.clone()
            x[0, 0] = float("inf")
        before = scaler.get_scale()
        train_step(ddp, opt, x, y, scaler)
        skipped.append(scaler.get_scale() < before)    # update() halves the scale on a skip
    return skipped
# --8<-- [end:recovery]


def powersgd_after_overflow(ctx, model, data) -> dict:
    ours = lambda: (PowerSGDState(rank=RANK, start_iter=2), powersgd_hook)  # noqa: E731
    torchs = lambda: (torch_powersgd.PowerSGDState(  # noqa: E731
        None, matrix_approximation_rank=RANK, start_powerSGD_iter=2, min_compression_rate=2,
        use_error_feedback=True, warm_start=True, random_seed=0), torch_powersgd.powerSGD_hook)
    overflow_at, out = 5, {}
    for name, make in (("ours", ours), ("torch", torchs)):
        skipped = overflow_recovery(ctx, model, data, make, overflow_at)
        out[name] = {"skipped": skipped, "skipped_after": sum(skipped[overflow_at + 1:])}
    out["overflow_step"], out["steps_after"] = overflow_at, len(skipped) - overflow_at - 1
    return out


# --- 3. training with each hook: loss, bytes, step time --------------------------------------

def train_with(ctx, model, data, test, name: str) -> dict:
    ddp = BucketedDDP(copy.deepcopy(model), bucket_cap_mb=CAP_MB)
    hook = make_hook(name, ctx.world_size)
    if hook is not None:
        ddp.register_comm_hook(*hook)
    opt, scaler, losses, times, counted = sgd(ddp, LR, MOMENTUM), scaler_for(ctx), [], [], None
    for step, (x, y) in enumerate(data):
        dist.barrier()
        start = time.perf_counter()
        if step == START_ITER + 1:                     # a compressed step, for every hook
            with count_bytes() as counted:
                losses.append(train_step(ddp, opt, x, y, scaler))
        else:
            losses.append(train_step(ddp, opt, x, y, scaler))
        wait_for_device(ctx)
        times.append((time.perf_counter() - start) * 1e3)
    with torch.no_grad():
        test_loss = F.cross_entropy(ddp.module(test[0]), test[1]).item()
    curve = torch.stack(losses).double()
    dist.all_reduce(curve)
    return {"loss": (curve / ctx.world_size).tolist(), "test_loss": test_loss,
            "step_ms": slowest(statistics.median(times[START_ITER + 1:])),
            "allreduce_calls": counted.calls, "payload_bytes": counted.payload_bytes,
            "wire_bytes_per_rank": counted.wire_bytes(ctx.world_size)}


# --- 4. one hook's time, alone: measured over the world, and its compute alone ---------------

def whole_gradient_bucket(params: list[torch.Tensor], flat: torch.Tensor) -> HookBucket:
    """One bucket holding every gradient (random values): what ``time_hook`` reduces."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return HookBucket(0, flat, views, params, is_last=True)


def time_hook(ctx, model, name: str, group, repeats: int) -> float:
    """Median ms of one hook over the whole gradient as one bucket (the slowest rank's).
    ``group``: None for all ranks; a group of this rank alone times the hook's compute."""
    params = list(model.parameters())
    gradient = torch.randn(sum(p.numel() for p in params),
                           generator=torch.Generator().manual_seed(ctx.rank)).to(ctx.device)
    state, hook = make_hook(name, ctx.world_size) or (None, default_hooks.allreduce_hook)
    if isinstance(state, PowerSGDState):
        state.start_iter, state.group = 0, group
    else:
        state = group
    samples = []
    for i in range(repeats + 2):                     # two warm-up calls
        bucket = whole_gradient_bucket(params, gradient.clone())
        dist.barrier()
        start = time.perf_counter()
        hook(state, bucket).wait()
        wait_for_device(ctx)
        if i >= 2:
            samples.append((time.perf_counter() - start) * 1e3)
    return slowest(statistics.median(samples)) if samples else 0.0


def hook_times(ctx, model, repeats: int) -> dict:
    alone = [dist.new_group([r]) for r in range(ctx.world_size)][ctx.rank]  # every rank: all
    out = {}
    for name in HOOKS:
        with count_bytes() as counted:               # warm-up calls only: two of them
            time_hook(ctx, model, name, None, 0)
        out[name] = {"measured_ms": time_hook(ctx, model, name, None, repeats),
                     "compute_ms": time_hook(ctx, model, name, alone, repeats),
                     "calls": counted.calls // 2, "payload_bytes": counted.payload_bytes // 2}
    return out


def worker(ctx: ddplab.RankContext, args) -> dict:
    torch.manual_seed(ctx.seed)
    model = build_model().to(ctx.device)
    data, test = batches(ctx, args.steps)
    out = {"world_size": ctx.world_size, "parameters": sum(p.numel() for p in model.parameters())}
    if ctx.world_size >= 2 and not args.sweep_only:
        out["equivalence"] = equivalence(ctx, model, data, steps=3 if ctx.quick else 12)
        out["scaler_skip"] = scaler_skip(ctx, model, data)
        out["powersgd_overflow"] = powersgd_after_overflow(ctx, model, data)
        out["hooks"] = hook_times(ctx, model, repeats=3 if ctx.quick else 10)
    out["runs"] = {name: train_with(ctx, model, data, test, name)  # each hook's training
                   for name in ddplab.progress(HOOKS, ctx, f"training, {ctx.world_size} rank(s)")}
    return out


# --- figures, summary, main --------------------------------------------------------------

def summarize(result: dict) -> str:
    lines = []
    eq = result.get("equivalence")
    if eq:
        same = [k for k, v in eq.items() if k.endswith("bucketed_vs_native") and v == 0.0]
        lines.append(f"same hook on BucketedDDP and native DDP: {len(same)} of "
                     f"{sum(k.endswith('bucketed_vs_native') for k in eq)} bit for bit")
        lines.append(f"our PowerSGD vs torch's: max |diff| "
                     f"{eq['our_powersgd_vs_torch_powersgd']:.2e}")
        lines.append(f"scaler skip per rank: with DDP {result['scaler_skip']['ddp']}, "
                     f"without averaging {result['scaler_skip']['local']}")
    for world, runs in sorted(result["sweep"].items()):
        lines.append(f"{world} rank(s): " + ", ".join(
            f"{h} {r['step_ms']:.0f} ms/step {r['payload_bytes'] / 2**20:.2f} MiB "
            f"final loss {r['loss'][-1]:.3f}" for h, r in runs.items()))
    pred = result.get("prediction", {})
    if "per_hook" in pred:
        lines.append("hook time measured | predicted (ms): " + ", ".join(
            f"{h} {r['measured_ms']:.1f} | {r['predicted_ms']:.1f}"
            for h, r in pred["per_hook"].items()))
    return "\n".join(lines)


def digest(sweep: dict) -> dict:
    """Per hook, what the page prints: bytes and their ratio to fp32, time, final loss."""
    world = "2" if "2" in sweep else max(sweep)
    runs, out = sweep[world], {"world_size": int(world)}
    tail = lambda loss: sum(loss[-10:]) / len(loss[-10:])  # noqa: E731  (less noisy than one)
    for h, r in runs.items():
        out[h] = {"payload_mib": r["payload_bytes"] / 2**20,
                  "bytes_saved_x": runs["none"]["payload_bytes"] / r["payload_bytes"],
                  "step_ms": r["step_ms"], "final_loss": tail(r["loss"]),
                  "test_loss": r["test_loss"],
                  "final_loss_by_world": {w: tail(sweep[w][h]["loss"]) for w in sweep}}
    out["verdict"] = digest_verdict(out)
    return out


def digest_verdict(rows: dict) -> dict:
    """What the table says: which hooks stepped slower than plain averaging here, and how far
    each hook's final loss is from plain averaging's (relative)."""
    hooks = [h for h in HOOKS if h != "none"]
    slower = [h for h in hooks if rows[h]["step_ms"] > rows["none"]["step_ms"]]
    loss = {h: rows[h]["final_loss"] / rows["none"]["final_loss"] - 1 for h in hooks}
    return {"slower_than_none": (", ".join(slower) if slower else "none of them"),
            "all_slower": len(slower) == len(hooks), "loss_vs_none": loss,
            "cast_loss_max_abs": max(abs(loss["fp16"]), abs(loss["bf16"])),
            "powersgd_loss": "higher" if loss["powersgd"] > 0 else "not higher"}


def bits_text(max_abs_diff: float) -> str:
    """What the largest parameter difference between two trainings says, in words."""
    return ("the same bits" if max_abs_diff == 0
            else f"not the same bits: they differ by up to {max_abs_diff:.3g}")


def parse_args(argv: list[str] | None = None) -> Namespace:
    parser = ddplab.chapter_parser(__doc__, prog="chapter09_compression.py")
    parser.add_argument("--steps", type=ddplab.positive(int), default=None, metavar="N",
                        help="training steps per hook (default: 300, --quick 30)")
    args = ddplab.parse_chapter_args(parser, argv)
    if args.steps is None:
        args.steps = 30 if args.quick else 300
    if args.steps <= START_ITER + 1:
        raise ddplab.UsageError(f"--steps must be above {START_ITER + 1}: PowerSGD starts "
                                f"compressing at step {START_ITER}")
    args.sweep_only = False
    return args


def finish(args, run: ddplab.Run) -> dict:
    """Rank 0's result, the world-size sweep (run here), and what chapter 03's model predicts."""
    result = run.result
    sweep = (launch_per_world_size(args, run, worker, main=result, sweep_only=True)
             or {result["world_size"]: result})  # under torchrun: this world size only
    result["sweep"] = {str(w): sweep[w].pop("runs") for w in sorted(sweep)}
    result["per_hook"] = digest(result["sweep"])
    if "equivalence" in result:
        result["equivalence"]["autocast_text"] = bits_text(
            result["equivalence"]["autocast_bucketed_vs_native"])
    result["training"] = {"steps": args.steps, "batch_per_rank": BATCH, "lr": LR,
                          "momentum": MOMENTUM, "powersgd_rank": RANK,
                          "powersgd_start_iter": START_ITER}
    if "hooks" in result:
        model = chapter03_calibration(args.out)
        result["prediction"] = prediction(result["hooks"], result["world_size"], model)
        result["where_it_pays"] = where_it_pays(result["hooks"], result["parameters"],
                                                world=8, loopback=model, rank=RANK)
    return result


def main(argv: list[str] | None = None) -> dict | None:
    return run_chapter(CHAPTER, parse_args(argv), worker, finish=finish,
                       draw=drawing.chapter09.draw,
                       summarize=lambda result, run: summarize(result))


if __name__ == "__main__":
    sys.exit(ddplab.run_main(main))

"""What chapter 11 records while sharded models train: the collectives' messages, a per-layer
timeline of FullyShardedDP's gathers and reduce-scatters, the ledger of the hand-written FSDP,
the first gradient element that two layouts sum differently, and the ring's halves timed.

Layered on, not woven in: the collectives are recorded by wrapping ``dist.all_gather_single`` and
``dist.reduce_scatter_single`` (``fully_shard`` looks them up on ``torch.distributed`` at each
call, ``_fsdp_collectives.DefaultAllGather``/``DefaultReduceScatter``, so it is recorded too), and
the timeline by wrapping one FullyShardedDP's ``_gather`` and ``_reduce_unit``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddplab.fsdp import FullyShardedDP
from ddplab.fsdp_layout import offsets, padded_rows, shard_major, shard_rows, split_shards
from ddplab.memory_ledger import (
    FP32,
    Ledger,
    ddp_ledger,
    local,
    measure,
    state_bytes,
    zero1_ledger,
    zero2_ledger,
    zero3_ledger,
)
from ddplab.ring_halves import ring_all_gather, ring_reduce_scatter
from ddplab.run.ranks import max_over_ranks, point_to_point_context

WRAPPED = {"all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single"}


@contextlib.contextmanager
def recorded_collectives():
    """Yield a list that collects (op, bytes of the whole message) for every call meanwhile:
    the output of an all-gather, the input of a reduce-scatter."""
    calls: list[tuple[str, int]] = []
    originals = {op: getattr(dist, name) for op, name in WRAPPED.items()}

    def wrap(op, original):
        def recording(output, input, *args, **kwargs):
            whole = output if op == "all_gather" else input
            calls.append((op, whole.numel() * whole.element_size()))
            return original(output, input, *args, **kwargs)
        return recording

    for op, name in WRAPPED.items():
        setattr(dist, name, wrap(op, originals[op]))
    try:
        yield calls
    finally:
        for op, name in WRAPPED.items():
            setattr(dist, name, originals[op])


def ddp_recording_hook(calls: list):
    """A DDP communication hook that records each bucket's bytes and all-reduces it as the
    default hook does (divide by N, then sum: `default_hooks._allreduce_fut`)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        buffer = bucket.buffer()
        calls.append(("all_reduce", buffer.numel() * buffer.element_size()))
        return allreduce_hook(state, bucket)
    return hook


def record_timeline(model: FullyShardedDP, names: list[str], start: float) -> list[dict]:
    """Wrap ``model``'s gathers, reduce-scatters and its units' forwards with timers; the list
    fills as it trains: {kind, layer, start_ms, end_ms} from ``start``."""
    events: list[dict] = []
    index = {id(u): i for i, u in enumerate(model.units)}

    def timed(kind, method):
        def run(unit, *args):
            t0 = time.perf_counter()
            # A call that finds nothing to do (already gathered, no gradient left) is no event.
            done = (unit.gathered if kind == "all-gather"
                    else all(f.grad is None for f in unit.full))
            out = method(unit, *args)
            if not done:
                events.append({"kind": kind, "layer": names[index[id(unit)]],
                               "start_ms": (t0 - start) * 1e3,
                               "end_ms": (time.perf_counter() - start) * 1e3})
            return out
        return run

    model._gather = timed("all-gather", model._gather)
    model._reduce_unit = timed("reduce-scatter", model._reduce_unit)
    for unit, name in zip(model.units, names, strict=True):
        began = {}
        unit.module.register_forward_pre_hook(lambda m, a, b=began: b.update(t=time.perf_counter()))
        unit.module.register_forward_hook(
            lambda m, a, o, b=began, n=name: events.append(
                {"kind": "forward", "layer": n, "start_ms": (b["t"] - start) * 1e3,
                 "end_ms": (time.perf_counter() - start) * 1e3}))
    return events


def hand_fsdp_ledger(shapes: list[tuple[int, ...]], world_size: int, rank: int,
                     optimizer: str = "adam") -> Ledger:
    """FullyShardedDP after a step: each parameter's rows unpadded as parameter and optimizer
    state; the gradients views into one reduce-scatter output per unit, padded (⌈d₀/N⌉ rows of
    every parameter)."""
    real = padded = 0
    for shape in shapes:
        inner = int(torch.Size(shape[1:]).numel())
        real += len(shard_rows(shape[0], rank, world_size)) * inner
        padded += padded_rows(shape[0], world_size) * inner
    state = state_bytes(real, len(shapes), optimizer)
    return Ledger(real * FP32, padded * FP32, state.optimizer_state, state.counters)


def ring_bytes(op: str, whole: int, world_size: int) -> float:
    """Bytes one rank sends for a ring collective over a ``whole``-byte message."""
    share = (world_size - 1) / world_size * whole
    return 2 * share if op == "all_reduce" else share


def held_and_predicted(stage, wrapped, optimizer, shapes, ctx) -> tuple[Ledger, Ledger]:
    """(bytes this rank holds, bytes the stage's formula says it holds) after a step."""
    rank, world = ctx.rank, ctx.world_size
    if stage == "zero2":
        numels = [sum(p.numel() for p in b.params) for b in wrapped.buckets]
        held = measure([*wrapped.module.parameters(), *wrapped.shard_parameters()], optimizer)
        return held, zero2_ledger(numels, world)
    if stage in ("zero1_ours", "zero1_native"):
        params = list(wrapped.parameters())
        return measure(params, optimizer.optim), zero1_ledger(params, world, rank)
    held = measure(wrapped.parameters(), optimizer)
    if stage == "fsdp_ours":
        return held, hand_fsdp_ledger(shapes, world, rank)
    if stage == "fully_shard":
        return held, zero3_ledger(shapes, world, rank)
    return held, ddp_ledger(list(wrapped.parameters()))


def timed(fn, repeats: int) -> list[float]:
    """Milliseconds per call after one warm-up, each call between barriers."""
    fn()
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


@contextlib.contextmanager
def _quiet_stderr():
    """Hide what the profiler's C++ side prints at start and stop (file descriptor 2)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profiler_peak_bytes(work, device: str = "cpu") -> int:
    """``memory_ledger.profiler_peak_bytes`` without the profiler's start and stop lines on
    stderr (the work itself prints as usual)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = profile(activities=activities, profile_memory=True)
    with _quiet_stderr():
        prof.__enter__()
    try:
        work()
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type().name == device.upper())
    running = peak = 0
    for _, nbytes in events:  # allocations are positive, frees negative
        running += nbytes
        peak = max(peak, running)
    return peak


def max_diff(xs, ys) -> float:
    """Largest |a - b| over pairs of tensors (DTensors: their local shards), over every rank."""
    worst = max(((local(a).double() - local(b).double()).abs().max().item()
                 for a, b in zip(xs, ys, strict=True) if local(a).numel()), default=0.0)
    return max_over_ranks(worst)


def adam_state(model, optimizer):
    return [optimizer.state[p][k] for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]


def gradients_held_before_last(model: FullyShardedDP, x, y, micro: int, sync_each: bool) -> int:
    """Gradient bytes ``model`` holds after all micro-batches but the last: its shards'
    gradients (reduce-scattered every micro-batch) or full, unsharded ones (sync off)."""
    import torch.nn.functional as F

    model.set_requires_gradient_sync(sync_each)
    for xm, ym in list(zip(x.chunk(micro), y.chunk(micro), strict=True))[:-1]:
        (F.cross_entropy(model(xm), ym) / micro).backward()
    model.set_requires_gradient_sync(True)
    full = sum(f.grad.untyped_storage().nbytes() for u in model.units for f in u.full
               if f.grad is not None)
    return full + int(measure(model.parameters()).grads)


def save_then_continue(args, run, save, resume) -> dict:
    """Launch ``save`` on 2 ranks, then ``resume`` on 3, with a checkpoint folder that is
    removed afterwards, whatever happens."""
    import tempfile
    from pathlib import Path

    from ddplab.run.cli import with_changes
    from ddplab.run.launch import launch

    if run.provenance["launcher"] == "torchrun":
        return {"skipped": "under torchrun the processes are the ranks: a script cannot start "
                           "other world sizes. Run it with python for the 2 -> 3 reload."}
    with tempfile.TemporaryDirectory(prefix="chapter11-dcp-") as folder:
        saved = launch(save, with_changes(args, checkpoint=Path(folder), world_size=2))
        loaded = launch(resume, with_changes(args, checkpoint=Path(folder), world_size=3))
    return {"saved_at": saved.result["world_size"], **loaded.result}


# --- the first element the two layouts sum differently ------------------------------------------

def shard_major_average(grads, shapes, rank: int, world: int) -> list[torch.Tensor]:
    """fully_shard's reduction (and FullyShardedDP's): the shard-major message, one
    reduce-scatter with AVG, this rank's row cut back into its shards."""
    message = shard_major(grads, world)
    row = message.new_empty(message.shape[1])
    dist.reduce_scatter_single(row, message.view(-1), op=dist.ReduceOp.AVG)
    return split_shards(row, shapes, rank, world)


def first_difference(model, batch, ctx, flat_average) -> dict | None:
    """One backward; each layer's gradients averaged shard-major (as ``fully_shard``) and by
    ``flat_average``: the first element (layer by layer, in element order) whose averaged bits
    differ, and where each layout puts it in its message (``fsdp_layout.offsets``).  None if
    every element agrees (always at 2 ranks)."""
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    layers = [(name, layer) for name, layer in model.named_children()
              if any(True for _ in layer.parameters())]
    every = [None] * ctx.world_size
    dist.all_gather_object(every, first_on_this_rank([m for _, m in layers], ctx,
                                                      flat_average))
    found = [e for e in every if e is not None]
    if not found:
        return None
    at, index, element, native, flat = min(found)  # the first layer, parameter, element
    name, layer = layers[at]
    param_name, param = list(layer.named_parameters())[index]
    shapes = [p.shape for p in layer.parameters()]
    position = ", ".join(str(int(i)) for i in torch.unravel_index(torch.tensor(element),
                                                                 param.shape))
    where = offsets(shapes, index, element, ctx.world_size)
    return {"element": f"{name}.{param_name}[{position}]", "owner": where["owner"],
            "shard_major_offset": where["shard_major"],
            "parameter_major_offset": where["parameter_major"],
            "message_numel": ctx.world_size * sum(padded_rows(s[0], ctx.world_size)
                                                  * s[1:].numel() for s in shapes),
            "fully_shard": native, "flat_layout": flat}


def first_on_this_rank(layers, ctx, flat_average) -> tuple | None:
    """(layer, parameter, element of the full parameter, both averages) of the first element
    of this rank's shards that the two layouts average differently.  Every rank reduces every
    layer: the collectives need them all."""
    rank, world, first = ctx.rank, ctx.world_size, None
    for at, layer in enumerate(layers):
        grads = [p.grad for p in layer.parameters()]
        shapes = [g.shape for g in grads]
        pairs = zip(shard_major_average(grads, shapes, rank, world),
                    flat_average(grads, shapes, rank, world), strict=True)
        for index, (native, flat) in enumerate(pairs):
            bad = (native.reshape(-1) != flat.reshape(-1)).nonzero()
            if first is None and bad.numel():
                local = bad[0].item()
                rows_before = shard_rows(shapes[index][0], rank, world).start
                first = (at, index, rows_before * shapes[index][1:].numel() + local,
                         native.reshape(-1)[local].item(), flat.reshape(-1)[local].item())
    return first


# --- the ring's two halves against gloo's, timed --------------------------------------------------

def ring_halves(ctx) -> dict:
    """Our ring reduce-scatter and all-gather against gloo's, and gloo's all-reduce, per size."""
    if point_to_point_context(ctx).backend != "gloo":
        return {"skipped": "the ring halves are timed on gloo (CPU tensors) only"}
    world, rows, reps = ctx.world_size, [], 5 if ctx.quick else 15
    for nbytes in [1 << 20, 4 << 20] if ctx.quick else [1 << 20, 4 << 20, 16 << 20]:
        n = nbytes // 4 // world * world
        message = torch.randn(n, generator=torch.Generator().manual_seed(ctx.rank))
        ours, theirs = torch.empty(n // world), torch.empty(n // world)
        gathered, reference = torch.empty(n * world), torch.empty(n * world)
        calls = {"ring_reduce_scatter": partial(ring_reduce_scatter, ours, message),
                 "gloo_reduce_scatter": partial(dist.reduce_scatter_single, theirs, message),
                 "gloo_all_reduce": lambda m=message: dist.all_reduce(m.clone()),
                 "ring_all_gather": partial(ring_all_gather, gathered, message),
                 "gloo_all_gather": partial(dist.all_gather_single, reference, message)}
        median = {k: statistics.median(timed(call, reps)) for k, call in calls.items()}
        rows.append({"bytes": n * 4, "median_ms": median,
                     "reduce_scatter_max_abs_diff": max_diff([ours], [theirs]),
                     "all_gather_max_abs_diff": max_diff([gathered], [reference])})
    return {"sizes": rows, "repeats": reps}

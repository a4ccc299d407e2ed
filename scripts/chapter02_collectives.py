"""Chapter 02 — the collectives, run on real tensors and drawn before and after.

Every rank holds a small integer tensor whose values say where they came from (rank r holds
10(r+1), 10(r+1)+1, …).  The script runs send/recv and each collective — broadcast, scatter,
gather, reduce, all_gather, all_reduce, reduce_scatter, all_to_all — prints what every rank held
before and after, and draws one figure per collective from those tensors.  Then it times each
collective on S bytes of float32 and compares with the bytes the standard algorithms move.

Run it:
    python scripts/chapter02_collectives.py                  # 4 CPU ranks, started by mp.spawn
    python scripts/chapter02_collectives.py --world-size 3
    torchrun --standalone --nproc-per-node 4 scripts/chapter02_collectives.py  # same, torchrun
    make run-chapter02
    python scripts/chapter02_collectives.py --replot         # only redraw the figures

On CPU this chapter defaults to 4 ranks, not 2: with two ranks, scatter, all_to_all and
reduce_scatter hardly look different from each other.  (On a GPU box: one rank per GPU.)
Writes out/chapter02/{send_recv, broadcast, scatter, gather, reduce, all_gather,
all_reduce, reduce_scatter, all_to_all}.png and results.json (or under --out DIR); the figures
are drawn from results.json alone (scripts/drawing/chapter02.py).
"""

from __future__ import annotations

import math
import sys
from functools import partial

import torch
import torch.distributed as dist

import ddplab
import drawing.chapter02
from ddplab.run import timing
from ddplab.run.chapter_main import run_chapter, the_folder
from ddplab.run.devices import gpu_count
from ddplab.run.launch import started_by_torchrun
from ddplab.run.ranks import point_to_point_context

CHAPTER = 2
CPU_WORLD_SIZE = 4
FLAT_COPIES = "gloo_flat_copies"  # timed with the collectives: see flat_copies
KiB, MiB = 1 << 10, 1 << 20
TIMED_BYTES, QUICK_TIMED_BYTES = 4 * MiB, 256 * KiB

# Newer torch (2.13, for one) renamed the flat-tensor variants; the old names warn but work.
REDUCE_SCATTER_FLAT = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def demo_tensor(ctx: ddplab.RankContext) -> torch.Tensor:
    """Rank r holds [10(r+1), 10(r+1)+1, …]: every value says which rank it came from."""
    base = 10 * (ctx.rank + 1) if ctx.world_size <= 9 else 100 * (ctx.rank + 1)
    return torch.arange(ctx.world_size, dtype=torch.int64, device=ctx.device) + base


# --- the collectives, one function each: (what this rank held before, what it holds after) ------

# --8<-- [start:send_recv]
def send_recv(x):
    """Each rank sends its tensor to the right neighbour and receives from the left one."""
    out = torch.empty_like(x)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    exchange = [dist.P2POp(dist.isend, x, right), dist.P2POp(dist.irecv, out, left)]
    for work in dist.batch_isend_irecv(exchange):  # both posted at once, then waited for
        work.wait()
    return x, out
# --8<-- [end:send_recv]


# --8<-- [start:broadcast]
def broadcast(x):
    out = x.clone()
    dist.broadcast(out, src=0)  # everyone ends up with rank 0's tensor
    return x, out
# --8<-- [end:broadcast]


# --8<-- [start:scatter]
def scatter(x):
    out = torch.empty(1, dtype=x.dtype, device=x.device)
    is_source = dist.get_rank() == 0
    pieces = list(x.chunk(dist.get_world_size())) if is_source else None  # only the source has data
    dist.scatter(out, scatter_list=pieces, src=0)  # rank r gets rank 0's piece r
    return (x if is_source else None), out
# --8<-- [end:scatter]


# --8<-- [start:gather]
def gather(x):
    mine = x[:1].clone()
    is_destination = dist.get_rank() == 0
    pieces = None  # only the destination passes a list to receive into
    if is_destination:
        pieces = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.gather(mine, gather_list=pieces, dst=0)  # only the destination receives
    return mine, (torch.cat(pieces) if is_destination else None)
# --8<-- [end:gather]


# --8<-- [start:reduce]
def reduce(x):
    out = x.clone()
    dist.reduce(out, dst=0)  # the sum lands on rank 0; don't read the others' buffers
    return x, out
# --8<-- [end:reduce]


# --8<-- [start:all_gather]
def all_gather(x):
    mine = x[:1].clone()
    pieces = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, mine)  # everyone receives everyone's piece
    return mine, torch.cat(pieces)
# --8<-- [end:all_gather]


# --8<-- [start:all_reduce]
def all_reduce(x):
    out = x.clone()
    dist.all_reduce(out)  # op=SUM by default: everyone ends up with the sum
    return x, out
# --8<-- [end:all_reduce]


# --8<-- [start:reduce_scatter]
def reduce_scatter(x):
    out = torch.empty(1, dtype=x.dtype, device=x.device)
    dist.reduce_scatter(out, list(x.chunk(dist.get_world_size())))  # rank r gets the sum of piece r
    return x, out
# --8<-- [end:reduce_scatter]


def reduce_scatter_by_all_reduce(out: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """The list-form reduce_scatter for a gloo that lacks it (torch before pytorch#149869, 2025,
    raised 'ProcessGroupGloo does not support reduce_scatter'): all-reduce every piece and keep
    this rank's, which is what gloo itself does since then."""
    summed = torch.cat(pieces)
    dist.all_reduce(summed)
    out.copy_(summed.chunk(len(pieces))[dist.get_rank()])


def use_fallbacks(support: dict) -> list[str]:
    """Swap in the fallback for each call this torch's backend refused; name what was swapped."""
    if support["reduce_scatter"] == "ok":
        return []
    # Rebinding the name in this process keeps the demo's code as the page shows it.
    dist.reduce_scatter = reduce_scatter_by_all_reduce
    return ["reduce_scatter"]


# --8<-- [start:all_to_all]
def all_to_all(x):
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)  # piece j of rank i goes to rank j, as its piece i
    return x, out
# --8<-- [end:all_to_all]


COLLECTIVES = {f.__name__: f for f in (send_recv, broadcast, scatter, gather, reduce,
                                       all_gather, all_reduce, reduce_scatter, all_to_all)}


def run_demos(ctx: ddplab.RankContext) -> dict:
    """Every collective on the demo tensor; every rank's before and after, on every rank."""
    states = {}
    for name, collective in COLLECTIVES.items():
        before, after = collective(demo_tensor(ctx))
        mine = [None if t is None else t.cpu().tolist() for t in (before, after)]
        everyone: list = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
        states[name] = {"before": [e[0] for e in everyone], "after": [e[1] for e in everyone]}
    return states


# --- what gloo in this torch can do -------------------------------------------------------------

def probe_support(ctx: ddplab.RankContext) -> dict:
    """Call each API once on tensors of ones; record 'ok', a wrong result, or the error.

    all_reduce_avg is all_reduce(op=ReduceOp.AVG), which gloo long refused; *_flat are the
    single-tensor variants (reduce_scatter_single / reduce_scatter_tensor, …).  Every output
    element must come out as ``expected``: running without an error is not enough.
    """
    n, dev = ctx.world_size, ctx.device
    ones = partial(torch.ones, device=dev)
    avg = dist.ReduceOp.AVG
    probes = {  # name: (size of the output, the call that fills it, what each element must be)
        "all_reduce_avg": (n, lambda out: dist.all_reduce(out.fill_(1), op=avg), 1),
        "reduce_scatter": (1, lambda out: dist.reduce_scatter(out, list(ones(n).chunk(n))), n),
        "reduce_scatter_flat": (1, lambda out: REDUCE_SCATTER_FLAT(out, ones(n)), n),
        "all_to_all": (n, lambda out: dist.all_to_all(list(out.chunk(n)),
                                                      list(ones(n).chunk(n))), 1),
        "all_to_all_single": (n, lambda out: dist.all_to_all_single(out, ones(n)), 1),
        "all_gather_flat": (n * n, lambda out: ALL_GATHER_FLAT(out, ones(n)), 1),
    }
    support = {}
    for name, (size, call, expected) in probes.items():
        out = torch.zeros(size, device=dev)
        try:
            call(out)
        except (RuntimeError, ValueError) as err:  # raised the same way on every rank
            support[name] = f"error: {str(err).strip().splitlines()[0]}"
            continue
        wrong = out[out != expected]
        support[name] = "ok" if wrong.numel() == 0 else (
            f"wrong result: {wrong[0].item():g} where {expected:g} was expected")
    return support


# --- the timing table ---------------------------------------------------------------------------

# Bytes the busiest rank sends and receives with the standard bandwidth-optimal algorithm, for
# N ranks and a full tensor of S bytes, and nccl-tests' bus-bandwidth factor (busbw = S/t·f),
# each as (how the page writes it, the fraction of S as a function of N).
ALL = ("S", lambda n: 1.0)
PIECE = ("S/N", lambda n: 1 / n)
ALL_BUT_ONE_PIECE = ("(N-1)/N·S", lambda n: (n - 1) / n)
TWICE_ALL_BUT_ONE = ("2(N-1)/N·S", lambda n: 2 * (n - 1) / n)
LOG_N = ("⌈log₂N⌉·S", lambda n: float(math.ceil(math.log2(n))))
# Every row is what gloo runs.  Broadcast and reduce (gloo/broadcast.cc: a binomial tree, the
# root sends S to each of ⌈log₂N⌉ peers; gloo/reduce.cc: a ring reduce-scatter, then a gather to
# the root, so a non-root rank sends (N-1)/N·S + S/N = S) are not NCCL's pipelined chain.  gloo
# has no reduce-scatter: PyTorch runs all-reduces for it, which move 2(N-1)/N·S.  The busbw
# factors stay nccl-tests', so the busbw column compares with an NCCL number.
TRAFFIC = {  # collective: (algorithm, sent, received, busbw factor)
    "send_recv": ("direct", ALL, ALL, ALL),
    "broadcast": ("binomial tree (gloo)", LOG_N, ALL, ALL),
    "scatter": ("direct from the root", ALL_BUT_ONE_PIECE, PIECE, ALL_BUT_ONE_PIECE),
    "gather": ("direct to the root", PIECE, ALL_BUT_ONE_PIECE, ALL_BUT_ONE_PIECE),
    "reduce": ("ring reduce-scatter, then gather to the root (gloo)", ALL,
               TWICE_ALL_BUT_ONE, ALL),
    "all_gather": ("ring", ALL_BUT_ONE_PIECE, ALL_BUT_ONE_PIECE, ALL_BUT_ONE_PIECE),
    "all_reduce": ("ring: reduce-scatter, then all-gather", TWICE_ALL_BUT_ONE,
                   TWICE_ALL_BUT_ONE, TWICE_ALL_BUT_ONE),
    "reduce_scatter": ("one all-reduce per piece (gloo)", TWICE_ALL_BUT_ONE, TWICE_ALL_BUT_ONE,
                       ALL_BUT_ONE_PIECE),
    "reduce_scatter_flat": ("all-reduce of the whole tensor, keep one piece (gloo)",
                            TWICE_ALL_BUT_ONE, TWICE_ALL_BUT_ONE, ALL_BUT_ONE_PIECE),
    "all_to_all": ("pairwise exchange", ALL_BUT_ONE_PIECE, ALL_BUT_ONE_PIECE, ALL_BUT_ONE_PIECE),
}


# --8<-- [start:timed]
def timed_steps(ctx: ddplab.RankContext, nbytes: int) -> dict:
    """One step per collective on S = nbytes of float32, buffers allocated outside the timing."""
    n, rank, dev = ctx.world_size, ctx.rank, ctx.device
    full = torch.randn(nbytes // 4, device=dev)
    piece = torch.randn(nbytes // 4 // n, device=dev)  # S/N
    pieces = [torch.empty_like(piece) for _ in range(n)]
    out_full, out_piece = torch.empty_like(full), torch.empty_like(piece)
    right, left = (rank + 1) % n, (rank - 1) % n

    def send_recv():
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, full, right),
                                            dist.P2POp(dist.irecv, out_full, left)]):
            work.wait()

    return {
        "send_recv": send_recv,
        "broadcast": lambda: dist.broadcast(full, src=0),
        "scatter": lambda: dist.scatter(out_piece, pieces if rank == 0 else None, src=0),
        "gather": lambda: dist.gather(piece, pieces if rank == 0 else None, dst=0),
        "reduce": lambda: dist.reduce(full, dst=0),
        "all_gather": lambda: dist.all_gather(pieces, piece),
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: dist.reduce_scatter(out_piece, pieces),
        "reduce_scatter_flat": lambda: REDUCE_SCATTER_FLAT(out_piece, full),
        "all_to_all": lambda: dist.all_to_all_single(out_full, full),
    }
# --8<-- [end:timed]


def flat_copies(ctx: ddplab.RankContext, nbytes: int):
    """What gloo's flat reduce-scatter does besides its all-reduce, as one step: it clones the
    whole input, all-reduces the clone, then copies this rank's piece out
    (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``)."""
    full = torch.randn(nbytes // 4, device=ctx.device)
    out = torch.empty(nbytes // 4 // ctx.world_size, device=ctx.device)
    return lambda: out.copy_(full.clone().chunk(ctx.world_size)[ctx.rank])


def time_collectives(ctx: ddplab.RankContext, nbytes: int) -> dict[str, float]:
    """Median time (ms) of each collective, and of ``flat_copies``, interleaved, as slow as
    the slowest rank."""
    steps = timed_steps(ctx, nbytes) | {FLAT_COPIES: flat_copies(ctx, nbytes)}
    samples = timing.compare(steps, rounds=5 if ctx.quick else 20, warmup=2, device=ctx.device)
    return {name: timing.slowest_rank(timing.median(s)) for name, s in samples.items()}


def copies_against_extra(copies: float, extra: float) -> str:
    """The copies' time as a share of the excess, or, when they took as long or longer, that
    they cover it (timed alone, they need not add up inside the collective)."""
    if f"{copies:.2f}" == f"{extra:.2f}":
        return "as long as that excess"
    if copies > extra:
        return "more than that excess: timed alone they cover it all"
    return (f"{copies / extra:.0%} of that; the other {extra - copies:.2f} ms this run does "
            f"not attribute")


def flat_reduce_scatter_verdict(time_ms: dict, backend: str) -> dict:
    """The flat reduce-scatter against the all-reduce of the same tensor, and how much of the
    difference gloo's copies around its all-reduce (timed alone) explain."""
    flat, all_reduce, copies = (time_ms[k] for k in ("reduce_scatter_flat", "all_reduce",
                                                     FLAT_COPIES))
    extra, ratio = flat - all_reduce, flat / all_reduce
    text = f"{ratio:.2f}× as long as the all-reduce of the same tensor"
    if backend != "gloo":
        text += f" (on {backend}, which does not run gloo's all-reduce-and-copy)"
    elif extra <= 0:
        text += ", no longer than it"
    else:
        text += (f", {extra:.2f} ms more: the clone and the copy out, timed alone, take "
                 f"{copies:.2f} ms, " + copies_against_extra(copies, extra))
    return {"ratio": ratio, "extra_ms": extra, "copies_ms": copies, "text": text}


def worker(ctx: ddplab.RankContext, args) -> dict | None:
    """Runs on every rank."""
    ctx = point_to_point_context(ctx)  # a GPU shared over gloo: CPU tensors (gloo's p2p)
    nbytes = QUICK_TIMED_BYTES if ctx.quick else TIMED_BYTES
    nbytes -= nbytes % (4 * ctx.world_size)  # whole float32 pieces for every rank
    support = probe_support(ctx)
    fallbacks = use_fallbacks(support)  # the same on every rank: the probe's verdict is shared
    result = {"states": run_demos(ctx), "support": support, "fallbacks": fallbacks,
              "timed_bytes": nbytes, "time_ms": time_collectives(ctx, nbytes)}
    return result if ctx.is_main else None


# --- table and summary (rank 0 / the launching process; figures: scripts/drawing/chapter02.py) --

def traffic_table(time_ms: dict, n: int, s: int) -> dict:
    rows = {}
    for name, t in time_ms.items():
        algorithm, sent, received, factor = TRAFFIC[name]
        algbw = s / (t * 1e-3) / 1e9
        rows[name] = {"algorithm": algorithm, "sent": sent[0], "received": received[0],
                      "sent_bytes": sent[1](n) * s, "received_bytes": received[1](n) * s,
                      "busbw_factor": factor[1](n), "time_ms": t, "algbw_gbps": algbw,
                      "busbw_gbps": algbw * factor[1](n)}
    return rows


def format_row(row) -> str:
    return "—" if row is None else "[" + ", ".join(map(str, row)) + "]"


def summarize(states: dict, table: dict, support: dict, n: int, s: int) -> str:
    lines = []
    for name, state in states.items():
        lines.append(f"{name}")
        for rank, (b, a) in enumerate(zip(state["before"], state["after"], strict=True)):
            lines.append(f"  rank {rank}: {format_row(b):<24} -> {format_row(a)}")
    lines.append(f"\ntimes for S = {s / KiB:g} KiB of float32 on {n} ranks (median):")
    lines.append("collective               sent/rank     time ms   busbw GB/s")
    for name, row in table.items():
        lines.append(f"{name:<24} {row['sent']:<12} {row['time_ms']:8.3f}   "
                     f"{row['busbw_gbps']:.2f}")
    lines.append("support: " + ", ".join(f"{k}: {v}" for k, v in support.items()))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None):
    parser = ddplab.chapter_parser(__doc__, prog="chapter02_collectives.py")
    args = ddplab.parse_chapter_args(parser, argv)
    if args.world_size == 1:
        raise ddplab.UsageError("chapter 02 needs at least 2 ranks to have anything to "
                                "communicate; use --world-size 2 or more")
    gpus = gpu_count()
    if args.world_size is None and not started_by_torchrun() and gpus < 2:
        args.world_size = CPU_WORLD_SIZE  # no GPUs: 4 CPU ranks draw clearer pictures than 2
    return args


def finish(args, run: ddplab.Run) -> dict:
    """results.json: the states, and each collective's time next to the bytes it moves."""
    result, n = run.result, run.provenance["world_size"]
    s = result["timed_bytes"]
    times = dict(result["time_ms"])
    table = traffic_table({k: v for k, v in times.items() if k != FLAT_COPIES}, n, s)
    return {
        "states": result["states"], "support": result["support"],
        "fallbacks": result["fallbacks"], "timed_bytes": s,
        "timed_kib": s / KiB, "collectives": table,
        # the names behind the *_flat keys in this torch
        "api": {"reduce_scatter_flat": REDUCE_SCATTER_FLAT.__name__,
                "all_gather_flat": ALL_GATHER_FLAT.__name__},
        "reduce_scatter_over_all_reduce_time":
            table["reduce_scatter"]["time_ms"] / table["all_reduce"]["time_ms"],
        "reduce_scatter_flat_over_all_reduce_time":
            table["reduce_scatter_flat"]["time_ms"] / table["all_reduce"]["time_ms"],
        "flat_copies_ms": times[FLAT_COPIES],
        "verdicts": {"reduce_scatter_flat": flat_reduce_scatter_verdict(
            times, run.provenance["backend"])},
    }


def summary(metrics: dict, run: ddplab.Run) -> str:
    lines = [summarize(metrics["states"], metrics["collectives"], metrics["support"],
                       run.provenance["world_size"], metrics["timed_bytes"])]
    for name in metrics["fallbacks"]:
        lines.append(f"note: this torch's {run.provenance['backend']} refused dist.{name} (see "
                     "support); the demo and the timing ran it as one all-reduce per piece instead")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict | None:
    return run_chapter(CHAPTER, parse_args(argv), worker, finish=finish,
                       draw=drawing.chapter02.draw,
                       summarize=summary, wrote=the_folder)


if __name__ == "__main__":
    sys.exit(ddplab.run_main(main))

"""Chapter 01 — processes, ranks, process groups, and identical replicas.

Every rank says who it is; the ranks split into two process groups and sum within each; then
each rank builds the same small model from a seed, and the script checks with collectives
that the replicas match when the seed is shared, differ when it is not, and match again after
rank 0's parameters are broadcast (what DistributedDataParallel does when it wraps a model).

Run it:
    python scripts/chapter01_processes.py                       # 2 CPU ranks, started by mp.spawn
    python scripts/chapter01_processes.py --world-size 4
    torchrun --standalone --nproc-per-node 2 scripts/chapter01_processes.py  # same code, torchrun
    python scripts/chapter01_processes.py --crash-rank 1        # see how a failing rank is reported
    python scripts/chapter01_processes.py --replot              # only redraw the figures

Writes out/chapter01/{ranks.png, replicas.png, replicas.json, results.json} (or under
--out DIR); the figures are drawn from the two JSON files alone (scripts/drawing/chapter01.py).
Chapter 01 is small enough that --quick changes nothing.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn

import ddplab
import drawing.chapter01
from ddplab.run.chapter_main import run_chapter
from ddplab.run.replot import write_figure_data

CHAPTER = 1


# --8<-- [start:whoami]
def whoami(device: torch.device) -> dict:
    """What this process knows about itself once it has joined the process group."""
    return {
        "rank": dist.get_rank(),                       # 0 … world_size-1, unique in the job
        "local_rank": int(os.environ["LOCAL_RANK"]),   # index on this machine: its GPU
        "world_size": dist.get_world_size(),           # number of ranks in the job
        "backend": dist.get_backend(),                 # gloo (CPU) or nccl (GPU)
        "device": str(device),
        "host": socket.gethostname(),
        "pid": os.getpid(),                            # every rank is its own OS process
        "threads": torch.get_num_threads(),            # CPU threads this rank may use
    }
# --8<-- [end:whoami]


# --8<-- [start:groups]
def sum_within_halves(device: torch.device) -> dict:
    """Split the world into two process groups and all-reduce inside each one.

    ``dist.new_group`` is itself collective: every rank must create every group, in the same
    order, even the groups it is not a member of.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    half = (world_size + 1) // 2
    lower = dist.new_group(ranks=list(range(half)))
    upper = dist.new_group(ranks=list(range(half, world_size))) if world_size > 1 else None
    mine, name = (lower, "lower half") if rank < half else (upper, "upper half")

    value = torch.tensor([float(rank)], device=device)
    dist.all_reduce(value, group=mine)  # sums over the members of `mine` only
    return {"group": name, "group_rank": dist.get_rank(mine),  # its rank inside `mine`
            "group_size": dist.get_world_size(mine), "group_sum_of_ranks": value.item()}
# --8<-- [end:groups]


def build_model() -> nn.Module:
    """A small MLP: big enough to have several tensors, small enough to draw."""
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


# --8<-- [start:compare]
def max_abs_diff_to_rank0(model: nn.Module, device: torch.device) -> float:
    """Largest |parameter − rank 0's parameter| over all ranks and parameters.

    Rank 0 broadcasts a flat copy of its parameters; every rank compares, and a MAX all-reduce
    gives every rank the same verdict.  0.0 means bit-for-bit identical replicas.
    """
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).to(device)
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    diff = (mine - rank0).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()
# --8<-- [end:compare]


# --8<-- [start:broadcast]
@torch.no_grad()
def copy_rank0_parameters(model: nn.Module) -> None:
    """Make every replica equal to rank 0's, whatever seeds built them (what DDP does at wrap)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor, src=0)
# --8<-- [end:broadcast]


def first_weights(model: nn.Module, device: torch.device) -> list[list[list[float]]]:
    """The top-left 8x8 block of the first layer's weight on every rank, for the figure."""
    block = model[0].weight.detach()[:8, :8].contiguous().to(device)
    blocks = [torch.empty_like(block) for _ in range(dist.get_world_size())]
    dist.all_gather(blocks, block)
    return [b.cpu().tolist() for b in blocks]


# --8<-- [start:replicas]
def replicas(seed: int, device: torch.device) -> dict:
    """Same seed on every rank: identical models.  A seed per rank: different models."""
    torch.manual_seed(seed)  # the same seed everywhere
    same_seed = build_model().to(device)

    torch.manual_seed(seed + dist.get_rank())  # a different seed on every rank: a classic bug
    seed_plus_rank = build_model().to(device)

    repaired = build_model().to(device)
    repaired.load_state_dict(seed_plus_rank.state_dict())
    copy_rank0_parameters(repaired)  # the fix: copy rank 0's parameters to everyone

    models = {"same_seed": same_seed, "seed_plus_rank": seed_plus_rank,
              "seed_plus_rank_then_broadcast": repaired}
    return {key: {"max_abs_diff": max_abs_diff_to_rank0(m, device),
                  "weights": first_weights(m, device)} for key, m in models.items()}
# --8<-- [end:replicas]


def worker(ctx: ddplab.RankContext, args) -> dict | None:
    """Runs on every rank."""
    if args.crash_rank == ctx.rank:
        raise RuntimeError(f"rank {ctx.rank} crashed on purpose (--crash-rank {args.crash_rank})")
    me = {**whoami(ctx.device), **sum_within_halves(ctx.device)}
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, me)  # any picklable object, not only tensors

    ranks = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(ranks)  # 0 + 1 + … + (N-1), the smallest check that everyone is there
    result = {"ranks": everyone, "all_reduce_sum_of_ranks": ranks.item(),
              "expected_sum_of_ranks": ctx.world_size * (ctx.world_size - 1) / 2,
              "replicas": replicas(ctx.seed, ctx.device)}
    return result if ctx.is_main else None


# --- reporting (rank 0 / the launching process; the figures: scripts/drawing/chapter01.py) ---

def summarize(result: dict) -> str:
    lines = ["rank  local  pid      device  group         group rank  group sum of ranks"]
    for r in result["ranks"]:
        lines.append(f"{r['rank']:>4}  {r['local_rank']:>5}  {r['pid']:<7}  {r['device']:<6}  "
                     f"{r['group']:<12}  {r['group_rank']} of {r['group_size']:<4}  "
                     f"{r['group_sum_of_ranks']:g}")
    lines.append(f"all_reduce(rank) = {result['all_reduce_sum_of_ranks']:g} "
                 f"(expected {result['expected_sum_of_ranks']:g})")
    for name, run in result["replicas"].items():
        verdict = "identical" if run["max_abs_diff"] == 0 else "DIFFERENT"
        label = drawing.chapter01.REPLICA_LABELS[name]
        lines.append(f"replicas, {label:<28} max |Δ| = {run['max_abs_diff']:.3g}  ({verdict})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None):
    parser = ddplab.chapter_parser(__doc__, prog="chapter01_processes.py")
    parser.add_argument("--crash-rank", type=int, default=None, metavar="R",
                        help="make rank R raise, to see how the launcher reports a failure")
    args = ddplab.parse_chapter_args(parser, argv)
    ddplab.check_rank("--crash-rank", args.crash_rank, args)  # 0..N-1, or it never crashes
    return args


def finish(args, run: ddplab.Run) -> dict:
    """results.json: the ranks' numbers; the replicas' weights go to replicas.json."""
    result = run.result
    return {**result, "replicas": {name: {"max_abs_diff": r["max_abs_diff"]}
                                   for name, r in result["replicas"].items()}}


def replica_weights(folder, metrics: dict, run: ddplab.Run) -> list[str]:
    write_figure_data(folder, "replicas.json",  # the weights replicas.png draws
                      {name: r["weights"] for name, r in run.result["replicas"].items()})
    return ["replicas.json"]


def main(argv: list[str] | None = None) -> dict | None:
    return run_chapter(CHAPTER, parse_args(argv), worker, finish=finish,
                       draw=drawing.chapter01.draw,
                       extras=replica_weights,
                       summarize=lambda metrics, run: summarize(run.result))


if __name__ == "__main__":
    sys.exit(ddplab.run_main(main))

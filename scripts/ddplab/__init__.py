"""ddplab: the small library the chapters of *DDP from Scratch* build, one concept per module.

    devices.py   --device/--backend: which backend, which device each rank computes on
    launch.py    run a function on N ranks (mp.spawn or torchrun), clean failures
    entry.py     a chapter's main: every failure as one clear last line and an exit code
    chapter_main.py  run_chapter: --replot, or launch, finish, write the folder, print
    stopping.py  every exit path (error, hang, Ctrl-C, SIGTERM) ends every process it started
    ranks.py     who am I: RankContext, get("rank"), seeding, progress bars
    cli.py       the flags every chapter shares, bad input as one clear line
    results.py   results.json with provenance, staged chapter output
    replot.py    --replot: a chapter's figures drawn from its run's files, no rank started
    fitting.py   least squares for a cost model (non-negative, on relative error)
    timing.py    fair step timing (warm-up, barriers, medians, A B A B)
    timeline.py  per-rank event timelines, Gantt charts, Chrome traces
    plotting.py  the book's figure style (imports matplotlib: import it where you draw)
    naive_ddp.py     NaiveDDP: after backward, one all-reduce per parameter (the tutorials' way)
    bucketed_ddp.py  BucketedDDP: buckets all-reduced during backward (native DDP's design)
    bucket_trace.py  BucketedDDP's buckets on a timeline (layered on, not woven in)
    ring.py          ring_all_reduce from send/recv (and a naive all-reduce through rank 0)
    bugs/            chapter 08's bug lab: real DDP failures as broken/fixed function pairs
    comm_hooks.py    communication hooks: GradBucket's API for BucketedDDP, fp16/bf16, byte counts
    powersgd.py      PowerSGD by hand (low-rank gradients, error feedback, warm start)
    precision.py     autocast's type for a device: bf16, or fp16 with a GradScaler
    hook_cost.py     chapter 03's α-β-γ model for a hook, and where compression pays
    netns.py         two emulated machines: network namespaces joined by a rate-limited veth
    costmodel.py     a DDP step's cost: the one link table, ring formula (α, β, γ), chapter 03
                     lookup and bucket layout; all-reduce (ring, tree, hierarchical), overlap
    nodes_verdicts.py  what chapter 10's numbers say, computed for its page
    sharded_optimizer.py  ShardedOptimizer: ZeRO-1, each rank steps and keeps its own state
    zero2.py         ShardedGradients: ZeRO-2, gradients reduce-scattered into per-rank shards
    memory_ledger.py what a rank holds under DDP and ZeRO-1/2/3: predicted, measured to the byte
    fsdp.py          FullyShardedDP: FSDP (ZeRO-3) by hand, bitwise with fully_shard
    fsdp_layout.py   where each shard and gradient element lives (padding, shard-major order)
"""

from .bucketed_ddp import BucketedDDP
from .cli import UsageError, chapter_parser, parse_chapter_args, positive
from .devices import Placement, place
from .entry import run_main
from .fsdp import FullyShardedDP
from .launch import RankFailed, Run, check_rank, launch
from .naive_ddp import NaiveDDP
from .ranks import RankContext, get, progress, seed_everything
from .results import chapter_output, read_results, write_results
from .ring import naive_all_reduce, ring_all_reduce
from .sharded_optimizer import ShardedOptimizer

__all__ = [
    "BucketedDDP",
    "FullyShardedDP",
    "NaiveDDP",
    "Placement",
    "RankContext",
    "RankFailed",
    "Run",
    "ShardedOptimizer",
    "UsageError",
    "chapter_output",
    "chapter_parser",
    "check_rank",
    "get",
    "launch",
    "naive_all_reduce",
    "parse_chapter_args",
    "place",
    "positive",
    "progress",
    "read_results",
    "ring_all_reduce",
    "run_main",
    "seed_everything",
    "write_results",
]

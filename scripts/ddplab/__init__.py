"""ddplab: what the reader of *DDP from Scratch* builds, one concept per module.

The code of the book lives in four rooms (tests/test_layout.py keeps them apart):

    ddplab/          what the reader builds: one concept per module, no argparse, no print, no
                     figure paths (this package)
    ddplab/run/      how a chapter runs: launching ranks, flags, results.json, timing, plotting
                     (see ddplab/run/__init__.py); names no chapter, imports no concept
    backstage/       one chapter's plumbing that is not its story (backstage/chapterNN*.py)
    drawing/         each chapter's figures, a pure function of its results.json

The concepts:

    ring.py              ring_all_reduce from send/recv (and a naive all-reduce through rank 0)
    ring_halves.py       the ring cut in half: reduce-scatter and all-gather from send/recv
    buckets.py           native DDP's bucket packing rule, once, for every caller
    hooked_buckets.py    gradients averaged in buckets, launched from autograd hooks (chapter 04)
    naive_ddp.py         NaiveDDP: after backward, one all-reduce per parameter (the tutorials' way)
    bucketed_ddp.py      BucketedDDP: buckets all-reduced during backward (native DDP's design)
    comm_hooks.py        communication hooks: GradBucket's API for BucketedDDP, fp16/bf16, bytes
    powersgd.py          PowerSGD by hand (low-rank gradients, error feedback, warm start)
    precision.py         autocast's type for a device: bf16, or fp16 with a GradScaler
    stragglers.py        where ranks wait: a late rank, the idle time of the others
    syncbn.py            SyncBatchNorm by hand: statistics over the whole global batch
    checkpoint.py        atomic checkpoints on rank 0, exact resume (RNG, sampler position)
    checkpoint_dcp.py    torch.distributed.checkpoint: every rank writes its share
    checkpoint_pitfalls.py  the ways a checkpoint goes wrong, each with the error it really gives
    costmodel.py         a DDP step's cost: the one link table, the ring formula (α, β, γ),
                         chapter 03's lookup, bucket layout; all-reduce (ring, tree, hierarchical)
    hook_costmodel.py    the α-β-γ model applied to communication hooks: where compression pays
    sharded_optimizer.py ShardedOptimizer: ZeRO-1, each rank steps and keeps its own state
    zero2.py             ShardedGradients: ZeRO-2, gradients reduce-scattered into per-rank shards
    memory_ledger.py     what a rank holds under DDP and ZeRO-1/2/3: predicted, measured to the byte
    fsdp.py              FullyShardedDP: FSDP (ZeRO-3) by hand, bitwise with fully_shard
    fsdp_layout.py       where each shard and gradient element lives (padding, shard-major order)
    bugs/                chapter 08's bug lab: real DDP failures as broken/fixed function pairs
                         (catalog, collectives, ddp_errors, silent, sharding, runner, diagnose)

This package also re-exports the API the chapter scripts, exercises and tests rely on, the
wrappers and the harness entry points (``ddplab.launch``, ``ddplab.get``, ...) from ddplab.run.
"""

from .bucketed_ddp import BucketedDDP
from .fsdp import FullyShardedDP
from .naive_ddp import NaiveDDP
from .ring import naive_all_reduce, ring_all_reduce
from .run.cli import UsageError, chapter_parser, parse_chapter_args, positive
from .run.devices import Placement, place
from .run.entry import run_main
from .run.launch import RankFailed, Run, check_rank, launch
from .run.ranks import RankContext, get, progress, seed_everything
from .run.results import chapter_output, read_results, write_results
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

"""ddplab: the small library the chapters of *DDP from Scratch* build, one concept per module.

    launch.py    run a function on N ranks (mp.spawn or torchrun), clean failures
    ranks.py     who am I: RankContext, get("rank"), seeding, progress bars
    cli.py       the flags every chapter shares, bad input as one clear line
    results.py   results.json with provenance, staged chapter output
    timing.py    fair step timing (warm-up, barriers, medians, A B A B)
    timeline.py  per-rank event timelines, Gantt charts, Chrome traces
    plotting.py  the book's figure style (imports matplotlib: import it where you draw)
    naive_ddp.py     NaiveDDP: after backward, one all-reduce per parameter (the tutorials' way)
    bucketed_ddp.py  BucketedDDP: buckets all-reduced during backward (native DDP's design)
    ring.py          ring_all_reduce from send/recv (and a naive all-reduce through rank 0)
    netns.py         two emulated machines: network namespaces joined by a rate-limited veth
    costmodel.py     a DDP step's cost: α-β all-reduce (ring, tree, hierarchical) and overlap
"""

from .bucketed_ddp import BucketedDDP
from .cli import UsageError, chapter_parser, parse_chapter_args, positive
from .launch import RankFailed, Run, choose_backend, launch, run_main
from .naive_ddp import NaiveDDP
from .ranks import RankContext, get, progress, seed_everything
from .results import chapter_output, read_results, write_results
from .ring import naive_all_reduce, ring_all_reduce

__all__ = [
    "BucketedDDP", "NaiveDDP",
    "RankContext", "RankFailed", "Run", "UsageError", "chapter_output", "chapter_parser",
    "choose_backend", "get", "launch", "naive_all_reduce", "parse_chapter_args", "positive",
    "progress", "read_results", "ring_all_reduce", "run_main", "seed_everything", "write_results",
]

"""The book's chapters, written once: every list of chapters derives from this table.

The site's index table and running.md's GPU table are rendered from it at build time
(tools/mkdocs_hooks.py); the results notebook, `make gpu-check`'s headlines and the graders'
file names read it; tests/test_registry.py checks that mkdocs.yml's nav, README's table, the
scripts, pages, drawings and tests agree with it.  Adding a chapter means adding a row here, a
script, a page, a drawing module and its tests.

    python scripts/chapters.py readme     # README's chapter table, to paste after editing a row
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Headline:
    """One number that tells at a glance whether a run made sense."""

    what: str
    key: str  # dotted path into results.json
    fmt: str = ""


@dataclass(frozen=True)
class Chapter:
    number: int
    slug: str  # scripts/chapterNN_<slug>.py, exercises/chapterNN_<slug>.py
    page_slug: str  # docs/chapters/NN-<page_slug>.md
    title: str  # the nav entry and the index's link text
    summary: str  # what the reader builds and sees
    one_gpu: str = ""  # running.md: what a 1-GPU box shows (ranks share the GPU over gloo)
    two_gpus: str = ""  # running.md: what needs one GPU per rank (nccl)
    headlines: tuple[Headline, ...] = ()
    exercises: bool = False  # exercises/chapterNN_<slug>.py, graded by `make grade-NN`

    @property
    def nn(self) -> str:
        return f"{self.number:02d}"

    @property
    def script(self) -> str:
        return "scripts/hello_ddp.py" if self.number == 0 else \
            f"scripts/chapter{self.nn}_{self.slug}.py"

    @property
    def page(self) -> str:
        return f"chapters/{self.nn}-{self.page_slug}.md"

    @property
    def has_results(self) -> bool:
        """A chapter script writes figures/chapterNN/results.json; Hello writes a model."""
        return self.number > 0


CHAPTERS = (
    Chapter(0, "hello_ddp", "hello-ddp", "Hello, DDP",
            "the whole data-parallel training script in plain `torch.distributed`, line by line: "
            "the one to copy"),
    Chapter(1, "processes", "processes", "Processes and ranks",
            "ranks, world size, local rank, backends, process groups; launching with `mp.spawn` "
            "and `torchrun`; identical replicas from one seed",
            "ranks, groups, identical replicas on the GPU", "one GPU per rank, nccl's rendezvous",
            (Headline("same seed on every rank: largest difference",
                      "replicas.same_seed.max_abs_diff", "g"),
             Headline("seed + rank: largest difference",
                      "replicas.seed_plus_rank.max_abs_diff", ".3g"),
             Headline("sum of the rank numbers, by all-reduce", "all_reduce_sum_of_ranks")),
            exercises=True),
    Chapter(2, "collectives", "collectives", "Collectives",
            "broadcast, scatter, gather, reduce, all-gather, all-reduce, reduce-scatter, "
            "all-to-all on real tensors, drawn rank by rank",
            "the collectives, on the CPU (gloo sends and receives CPU tensors only)",
            "every collective on GPU tensors, what nccl itself runs and costs",
            exercises=True),
    Chapter(3, "ring_allreduce", "ring-allreduce", "Ring all-reduce",
            "all-reduce from `send`/`recv`, checked against `dist.all_reduce`, benchmarked, and "
            "explained with the α-β model",
            "the ring on the CPU, as on a laptop (gloo's point-to-point)",
            "NVLink/PCIe bandwidth, the α-β fit of a real link",
            (Headline("ring equals dist.all_reduce", "correct"),
             Headline("ring busbw / gloo busbw, largest size",
                      "largest.ratio_ring_to_native_busbw", ".2f"),
             Headline("α-β fit R², ring", "alpha_beta.ring.r2", ".3f"),
             Headline("α-β fit R², gloo", "alpha_beta.native.r2", ".3f")),
            exercises=True),
    Chapter(4, "hooks", "hooks", "Autograd hooks and buckets",
            "the order gradients become ready, buckets, overlapping communication with backward",
            "hooks and buckets on GPU kernels; overlap measured with CUDA events",
            "overlap with nccl kernels that compete for the SMs",
            (Headline("ready order vs forward order: rank correlation",
                      "gradient_ready.rank_correlation_with_forward_order", ".2f"),),
            exercises=True),
    Chapter(5, "data_parallel", "data-parallel", "Data-parallel training",
            "a hand-written DDP, naive and then bucketed, against native DDP: same parameters, "
            "measured speed",
            "bitwise equality on the GPU, GPU memory", "speed-up from more GPUs",
            (Headline("NaiveDDP vs native DDP: largest difference",
                      "equivalence.naive_vs_native", "g"),
             Headline("BucketedDDP vs native DDP: largest difference",
                      "equivalence.bucketed_vs_native", "g"),
             Headline("NaiveDDP step time / native", "ratio_to_native.naive", ".2f"),
             Headline("BucketedDDP step time / native", "ratio_to_native.bucketed", ".3f")),
            exercises=True),
    Chapter(6, "bubbles", "bubbles", "Bubbles and stragglers",
            "where ranks wait: timelines, stragglers, SyncBatchNorm, uneven inputs and `Join`",
            "idle time from CUDA events, the `.item()` stall",
            "nccl's barrier and hang behaviour",
            (Headline("on-time rank's idle ms per ms of delay", "straggler.slope_idle", ".2f"),
             Headline("uneven inputs with Join completed", "uneven.join_completed")),
            exercises=True),
    Chapter(7, "checkpointing", "checkpointing", "Checkpointing and failures",
            "atomic saves, bit-for-bit resume, distributed checkpoints, restarting after a crash",
            "saving and resuming GPU state, `map_location`",
            "DCP over nccl: each replicated tensor written by one rank, the writing spread "
            "over the ranks (DDP shards nothing)",
            (Headline("resumed vs uninterrupted: largest difference", "resume.max_abs_diff", "g"),
             Headline("torchrun restart vs uninterrupted: largest difference",
                      "restart.max_abs_diff", "g")),
            exercises=True),
    Chapter(8, "bug_lab", "bug-lab", "The bug lab",
            "real DDP failures: the exact error, the tool that finds it, the fix",
            "what a laptop shows: the lab runs its bugs on CPU processes over gloo, whatever the "
            "machine",
            "the GPU-only bugs, which the page describes but nothing runs: two ranks on one GPU "
            "(*Duplicate GPU detected*), an NCCL hang ended by the watchdog"),
    Chapter(9, "compression", "compression", "Mixed precision and compression",
            "autocast and GradScaler with DDP; one comm-hook API for both DDPs; fp16, bf16 and "
            "PowerSGD by hand; bytes, loss, a predicted time, where compression pays",
            "autocast in bf16 (or fp16 + `GradScaler` on GPUs without fast bf16), the hooks on "
            "GPU tensors, hook compute timed on the GPU",
            "the hooks over nccl, and the prediction checked against a real link",
            (Headline("our PowerSGD vs torch's: largest difference",
                      "equivalence.our_powersgd_vs_torch_powersgd", "g"),),
            exercises=True),
    Chapter(10, "many_nodes", "many-nodes", "Many machines",
            "two emulated nodes over a rate-limited link, `torchrun --nnodes 2`, a cost model to "
            "1024 GPUs, SLURM and Kubernetes recipes",
            "what a laptop shows: the emulated nodes run CPU ranks over gloo, and the cost model "
            "needs no GPU",
            "real multi-node runs: one `torchrun` per machine (the recipes)",
            (Headline("two-node failover vs uninterrupted: largest difference",
                      "two_node.failover.max_abs_diff", "g"),)),
    Chapter(11, "sharding", "sharding", "Sharding: ZeRO and FSDP",
            "the memory ledger, counted to the byte; ZeRO-1, ZeRO-2 and FSDP by hand, bitwise "
            "against `ZeroRedundancyOptimizer` and `fully_shard`; bytes per step; a sharded "
            "checkpoint saved at 2 ranks and continued at 3",
            "the ledger, the equality and the timeline with the ranks sharing the GPU over gloo "
            "(`fully_shard` on a CUDA mesh)",
            "FSDP's gathers and reduce-scatters on nccl, and the ring's halves against nccl's "
            "(the script times the halves on gloo only)",
            (Headline("FullyShardedDP vs fully_shard: largest difference",
                      "equality.max_abs_diff.fsdp_ours_vs_fully_shard", "g"),
             Headline("ShardedOptimizer vs ZeroRedundancyOptimizer: largest difference",
                      "equality.max_abs_diff.zero1_ours_vs_zero_redundancy", "g"),
             Headline("fully_shard bytes sent per step / DDP's",
                      "verdicts.fsdp_sends_over_ddp", ".2f"),
             Headline("DCP 2 -> 3 ranks, continued: largest difference",
                      "reshard.continued_max_abs_diff", "g")),
            exercises=True),
)


def by_number(number: int) -> Chapter:
    for chapter in CHAPTERS:
        if chapter.number == number:
            return chapter
    raise KeyError(f"there is no chapter {number:02d} "
                   f"(chapters: {', '.join(c.nn for c in CHAPTERS)})")


def with_exercises() -> list[Chapter]:
    return [c for c in CHAPTERS if c.exercises]


def with_results() -> list[Chapter]:
    return [c for c in CHAPTERS if c.has_results]


def index_table() -> str:
    """docs/index.md's table (links relative to docs/)."""
    rows = ["| | Chapter | What you build and see |", "|--|---------|-----------------------|"]
    rows += [f"| {c.nn} | [{c.title}]({c.page}) | {c.summary} |" for c in CHAPTERS]
    return "\n".join(rows)


def readme_table() -> str:
    rows = ["| | Script | What you build and see |", "|--|--------|------------------------|"]
    rows += [f"| {c.nn} | `{c.script}` | {c.summary} |" for c in CHAPTERS]
    return "\n".join(rows)


def gpu_table() -> str:
    """running.md's table: what one GPU shows, and what needs one GPU per rank."""
    rows = ["| Chapter | 1 GPU shows | needs 2+ GPUs |", "|---|---|---|"]
    rows += [f"| {c.nn} {c.title} | {c.one_gpu} | {c.two_gpus} |"
             for c in CHAPTERS if c.one_gpu]
    return "\n".join(rows)


if __name__ == "__main__":
    tables = {"readme": readme_table, "index": index_table, "gpu": gpu_table}
    if len(sys.argv) != 2 or sys.argv[1] not in tables:
        sys.exit(f"usage: python scripts/chapters.py {{{'|'.join(tables)}}}")
    print(tables[sys.argv[1]]())

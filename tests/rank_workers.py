"""Functions the launcher tests run on every rank (importable, as mp.spawn requires)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ddplab


def report_ranks(ctx: ddplab.RankContext, args) -> dict:
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, (ctx.rank, ddplab.get("ws"), ddplab.get("lrank")))
    total = torch.tensor([float(ctx.rank)])
    dist.all_reduce(total)
    return {"everyone": everyone, "sum": total.item(), "threads": torch.get_num_threads(),
            "pg_is_world": ddplab.get("pg") is dist.group.WORLD}


def rank1_raises(ctx: ddplab.RankContext, args) -> None:
    if ctx.rank == 1:
        raise ValueError("rank 1 broke on purpose")
    dist.barrier()  # rank 0 waits here for a peer that is gone


def rank1_never_arrives(ctx: ddplab.RankContext, args) -> None:
    if ctx.rank == 1:
        time.sleep(60)  # much longer than the test's --timeout
        (Path(args.out) / "rank1-woke-up").touch()  # only if the launcher did not stop it
    dist.barrier()


def random_draw(ctx: ddplab.RankContext, args) -> list[float]:
    """What the launcher's seeding gives: the same draws on every rank."""
    draws = [None] * ctx.world_size
    dist.all_gather_object(draws, torch.rand(3).tolist())
    return draws


class _StdoutThatAbortsInTeardown:
    """Stands in for sys.stdout; flushed by the interpreter's teardown, it aborts the process."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(text)

    def flush(self) -> None:
        if sys.is_finalizing():
            os.abort()
        self.stream.flush()


def teardown_aborts(ctx: ddplab.RankContext, args) -> int:
    """Finishes its work, but the interpreter's teardown would then abort the process (SIGABRT),
    as a process group's thread rarely does at exit."""
    sys.stdout = _StdoutThatAbortsInTeardown(sys.stdout)
    dist.barrier()
    return ctx.world_size


def leaves_a_writer_thread(ctx: ddplab.RankContext, args) -> None:
    """Returns while a (non-daemon) thread still writes a file, as a background saver might."""
    def write_later() -> None:
        time.sleep(0.5)
        (Path(args.out) / f"written-by-rank{ctx.rank}.txt").write_text("done")

    threading.Thread(target=write_later).start()

"""Who am I? The facts a rank needs about itself, and small helpers that depend on them.

A *rank* is one process of the job.  Its global ``rank`` numbers it among all processes
(0 … world_size-1); its ``local_rank`` numbers it among the processes on its own machine, and is
the GPU it drives.  On one machine the two are equal; on two machines with 4 GPUs each, global
rank 5 is local rank 1 of the second machine.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TextIO

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class RankContext:
    """What ``ddplab.launch`` tells the function it runs on every rank."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device
    seed: int
    quick: bool
    launcher: str  # "mp.spawn" or "torchrun"

    @property
    def is_main(self) -> bool:
        """Rank 0 prints, plots and writes files; the others only compute."""
        return self.rank == 0


def native_ddp(model: nn.Module, ctx: RankContext, **kwargs) -> DistributedDataParallel:
    """Native DDP around ``model`` on this rank's device: one GPU per rank names its own in
    ``device_ids``; on the CPU there is none to name.  ``kwargs``: DDP's (bucket_cap_mb, ...)."""
    device_ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model.to(ctx.device), device_ids=device_ids, **kwargs)


def point_to_point_context(ctx: RankContext) -> RankContext:
    """gloo has no send/recv for CUDA tensors: where the ranks share a GPU over gloo, a chapter
    that sends and receives (02, 03) keeps its tensors on the CPU (docs/running.md says so)."""
    if ctx.backend == "gloo" and ctx.device.type == "cuda":
        return replace(ctx, device=torch.device("cpu"))
    return ctx


_GET_KEYS = {
    "ws": "world size of the group",
    "rank": "rank within the group",
    "grank": "global rank (in the default group)",
    "lrank": "local rank (index of this process on its machine)",
    "pg": "the process group itself",
}


def get(what: str, group: dist.ProcessGroup | None = None):
    """Look up one fact about this process, like the seed tutorial's ``get``.

    ``get("ws")`` world size, ``get("rank")`` rank in ``group``, ``get("grank")`` global rank,
    ``get("lrank")`` local rank, ``get("pg")`` the group (the default group if ``group`` is None).
    """
    if what not in _GET_KEYS:
        known = ", ".join(f"{k!r} ({v})" for k, v in _GET_KEYS.items())
        raise ValueError(f"get({what!r}): unknown key; use one of {known}")
    if not dist.is_initialized():
        raise RuntimeError(f"get({what!r}) needs a process group: call it inside ddplab.launch")
    if what == "ws":
        return dist.get_world_size(group)
    if what == "rank":
        return dist.get_rank(group)
    if what == "grank":
        return dist.get_rank()
    if what == "lrank":
        # Launchers put it in the environment; a single machine without one has lrank == rank.
        return int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    return group if group is not None else dist.group.WORLD


def seed_everything(seed: int) -> None:
    """Seed every generator a chapter uses, so the same seed builds the same model on every rank."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np
    except ImportError:  # numpy is optional for the library itself
        return
    np.random.seed(seed % 2**32)


def progress(iterable: Iterable, ctx: RankContext, desc: str, total: int | None = None,
             stream: TextIO | None = None):
    """Rank 0 reports progress; the other ranks stay quiet (N bars over each other help nobody).

    On a terminal: a tqdm bar.  Into a log or CI output (``stream`` is not a terminal), a bar
    would be thousands of ``\\r`` updates, so it is a plain line every ``LINE_EVERY_S`` seconds
    or ``LINE_EVERY_PERCENT`` %, and one at the end.  ``stream`` defaults to stderr, like tqdm.
    """
    if not ctx.is_main:
        return iterable
    stream = sys.stderr if stream is None else stream
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if stream.isatty():
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True, file=stream)
    return progress_lines(iterable, desc, total, stream)


LINE_EVERY_S = 10.0
LINE_EVERY_PERCENT = 10


def progress_lines(iterable: Iterable, desc: str, total: int | None, stream: TextIO):
    """Yield from ``iterable``, printing ``desc: done/total (pct %), N s`` now and then."""
    start = last_time = time.monotonic()
    last_percent = done = printed = 0
    for item in iterable:
        yield item
        done += 1
        now = time.monotonic()
        percent = 100 * done // total if total else 0
        if (done == total or now - last_time >= LINE_EVERY_S
                or percent >= last_percent + LINE_EVERY_PERCENT):
            of_total = f"/{total} ({percent} %)" if total else ""
            print(f"{desc}: {done}{of_total}, {now - start:.0f} s", file=stream, flush=True)
            last_time, last_percent, printed = now, percent, done
    if done != printed and not total:  # an iterable of unknown length: say where it ended
        print(f"{desc}: {done} done, {time.monotonic() - start:.0f} s", file=stream, flush=True)


def max_over_ranks(values: torch.Tensor | float) -> torch.Tensor | float:
    """Element-wise maximum over all ranks (collective), back on the CPU; given a number, the
    largest number (sent as float64: no rounding).  On nccl the tensor travels through this
    rank's GPU."""
    if not isinstance(values, torch.Tensor):
        return max_over_ranks(torch.tensor([values], dtype=torch.float64)).item()
    values = values.to(collective_device())
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.cpu()


def mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """Element-wise mean over all ranks (collective), back on the CPU."""
    values = values.to(collective_device())
    dist.all_reduce(values)
    return values.cpu() / dist.get_world_size()


def collective_device() -> torch.device:
    """Collectives on nccl need CUDA tensors; gloo takes CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

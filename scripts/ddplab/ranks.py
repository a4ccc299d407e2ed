"""Who am I? The facts a rank needs about itself, and small helpers that depend on them.

A *rank* is one process of the job.  Its global ``rank`` numbers it among all processes
(0 … world_size-1); its ``local_rank`` numbers it among the processes on its own machine, and is
the GPU it drives.  On one machine the two are equal; on two machines with 4 GPUs each, global
rank 5 is local rank 1 of the second machine.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def progress(iterable: Iterable, ctx: RankContext, desc: str, total: int | None = None):
    """A tqdm bar on rank 0 only (N ranks drawing N bars over each other helps nobody)."""
    if not ctx.is_main:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)

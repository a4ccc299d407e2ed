"""Which rank failed first: the cause, not the peers that failed because it went away.

When one rank dies, its peers fail too ("Connection closed by peer").  Each failing rank
claims the failure in the rendezvous store with an atomic compare-and-set; the first claim
names the cause.  The claim also says whether the claimant's own error was only a follow-on:
a gloo timeout closes the timed-out rank's connections before that rank can claim (gloo's
``Pair::signalException`` moves the pair to CLOSED), so its peer's "closed by peer" may claim
first, and the launcher must still report the timeout.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist


class Claim(NamedTuple):
    """The rank that failed first, and whether its own error was only a follow-on."""
    rank: int
    follow_on: bool


def claim_failure(store: dist.Store | None, rank: int, err: BaseException,
                  timeout: float) -> Claim | None:
    """Atomically record 'rank failed' unless a rank already did; return who failed first."""
    follow_on = is_follow_on(one_line(err))
    try:
        if store is None:  # torchrun: its store listens at MASTER_ADDR:MASTER_PORT
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=timedelta(seconds=min(timeout, 5)))
        # torchrun may keep its store across restarts (--max-restarts): one key per attempt.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        mine = f"{rank} follow-on" if follow_on else str(rank)
        first = store.compare_set(f"ddplab/first_failure/{attempt}", "", mine).decode()
        return Claim(int(first.split()[0]), first.endswith("follow-on"))
    except Exception:  # the store itself is gone: we cannot tell who was first
        return None


def a_cause_behind(first: Claim, err: BaseException) -> bool:
    """This rank has a cause of its own (a timeout, say) and the rank that claimed first only
    heard of a failure: report this rank's error too."""
    return first.follow_on and not is_follow_on(one_line(err))


def is_follow_on(summary: str) -> bool:
    """The error says only that a peer went away."""
    return "Connection closed by peer" in summary or "Connection reset by peer" in summary


def one_line(err: BaseException) -> str:
    """'ValueError: first line of the message' — the line a reader sees last."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__

"""Run one scenario, broken or fixed, and write down what happened: the first lines of each
rank's error, how long it took to surface, the giveaway number of a silent bug.

Inside a launch every scenario gets a fresh process group with a short timeout, so a hang ends
in seconds and leaves the default group healthy for the next scenario.  Errors are caught: many
scenarios share one launch (starting ranks costs more than most scenarios take).
"""

from __future__ import annotations

import importlib
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from .catalog import BY_NAME, Scenario
from .collectives import port_held_by_another_job

HANG_TIMEOUT_S = 2.0  # a rank left waiting in a scenario's group gives up after this long
FOLLOW_ON = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer")


def error_lines(err: BaseException, keep: int = 12) -> list[str]:
    """'Type: first line' and the lines after it, as the reader sees the end of a traceback."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    head = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return [head, *lines[1:keep]]


def run_on_this_rank(sc: Scenario, fixed: bool, ctx, scratch: Path, group=None) -> dict:
    """Run ``sc`` on this rank; every rank must call this for the same scenario, in order."""
    if group is None:
        group = dist.new_group(timeout=timedelta(seconds=HANG_TIMEOUT_S))
    # The first DDP in a process imports torch._dynamo (seconds on a small machine): done
    # before the clock starts, so a scenario's time is the bug's, not an import's.
    importlib.import_module("torch._dynamo")
    start = time.perf_counter()
    mine: dict = {"rank": ctx.rank, "error": None, "value": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            mine["value"] = (sc.fixed() if fixed else sc.broken())(ctx, group, scratch)
        except Exception as err:
            mine["error"] = error_lines(err)
    mine["seconds"] = time.perf_counter() - start
    mine["warnings"] = sorted({str(w.message).splitlines()[0][:300] for w in caught})
    return mine


def gather_outcome(sc: Scenario, fixed: bool, mine: dict) -> dict:
    """Every rank's result on every rank, judged the same way everywhere."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return judge(sc, fixed, everyone)


def run_in_main(sc: Scenario, fixed: bool) -> dict:
    """The scenarios that happen before there is any rank: no launch, no process group."""
    start = time.perf_counter()
    mine: dict = {"rank": None, "error": None, "value": None}
    taken = None
    try:
        if sc.name == "port_taken":
            other_job = port_held_by_another_job()
            taken = other_job.getsockname()[1]
            try:
                store = (sc.fixed() if fixed else sc.broken())(taken)
                mine["value"] = f"the store listens on port {store.port}"
                del store
            finally:
                other_job.close()
        else:
            mine["value"] = (sc.fixed() if fixed else sc.broken())()
    except Exception as err:
        mine["error"] = error_lines(err)
    mine["seconds"] = time.perf_counter() - start
    mine["warnings"] = []
    record = judge(sc, fixed, [mine])
    if taken is not None:
        record["port"] = taken  # the port the other job held: the page's `ss` command names it
    return record


def judge(sc: Scenario, fixed: bool, everyone: list[dict]) -> dict:
    """One record: did the symptom show, which line shows it, how long until it surfaced."""
    failed = [r for r in everyone if r["error"]]
    values = [r["value"] for r in everyone if isinstance(r["value"], dict)]
    unhealthy = [v for v in values if "healthy" in v and not v["healthy"]]
    # The most telling error: a rank's own error rather than a timeout or a closed connection.
    own = [r for r in failed if not any(f in r["error"][0] for f in FOLLOW_ON)]
    shown = (own or failed or [None])[0]
    record = {
        "scenario": sc.name, "kind": sc.kind, "version": "fixed" if fixed else "broken",
        "symptom": bool(failed or unhealthy),
        "clean": not failed and not unhealthy,
        "first_line": shown["error"][0] if shown else None,
        "lines": shown["error"] if shown else [],
        "rank_shown": shown["rank"] if shown else None,
        "errors": {str(r["rank"]): r["error"][0] for r in failed},
        "seconds": (min(r["seconds"] for r in failed) if failed
                    else max(r["seconds"] for r in everyone)),
        "warnings": sorted({w for r in everyone for w in r["warnings"]}),
    }
    if values:
        first = values[0]
        record.update(giveaway=first.get("giveaway"), giveaway_text=first.get("text"),
                      value=_plain(first))
    elif everyone[0]["value"] is not None:
        record["value"] = _plain(everyone[0]["value"])
    return record


def _plain(value):
    """What results.json can hold: numbers, strings, lists, dicts of them."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)


def scenario(name: str) -> Scenario:
    return BY_NAME[name]

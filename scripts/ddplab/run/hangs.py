"""Jobs that hang on purpose: run one with a short timeout, and see where each rank was.

A hang demonstration must not hang the chapter: ``run_hang_demo`` launches it as a job of its
own (fresh ranks, its own process group) with a timeout of a few seconds, and turns the failure
into a record: what happened, the error, the line the failing rank was waiting on, and each
rank's **flight recorder** — its last collectives, as the process group saw them.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .cli import with_changes
from .launch import RankFailed, launch, started_by_torchrun


# --8<-- [start:flight_recorder]
def dump_flight_recorder(path: Path) -> None:
    """Write this rank's flight recorder (its last collectives: kind, sizes, state) to ``path``.

    It records by default in torch 2.13: TORCH_FR_BUFFER_SIZE (entries kept, read when the
    first process group starts) defaults to 2000, and 0 turns it off (FlightRecorder.hpp).
    NCCL's watchdog writes it by itself when a collective times out; gloo (torch 2.13) records
    but never writes it: call this where the timeout surfaces, in an ``except`` block.
    """
    from torch._C._distributed_c10d import _dump_fr_trace  # private: no public API yet

    Path(path).write_bytes(_dump_fr_trace())


def last_collectives(path: Path, count: int = 2) -> list[str]:
    """The last ``count`` collectives in a dump, oldest first: ``#seq kind sizes``."""
    entries = pickle.loads(Path(path).read_bytes()).get("entries", [])
    return [f"#{e['collective_seq_id']} {e['profiling_name']} {e['input_sizes']}"
            for e in entries[-count:]]
# --8<-- [end:flight_recorder]


def run_hang_demo(demo: Callable, args, timeout_s: float) -> dict:
    """Run ``demo(ctx, args)`` on fresh ranks with a ``timeout_s`` timeout, expecting it to
    fail; return what happened (under torchrun: skipped, the processes are the ranks)."""
    if started_by_torchrun():
        return {"what_happened": "skipped under torchrun: run the script with python to see it",
                "why": "under torchrun the processes are the ranks, and a job that hangs on "
                       "purpose would end the run", "timed_out": None}
    job = with_changes(args, timeout=timeout_s, demo=demo)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, flight_recorder_on():
        job.flight_recorder_dir = tmp
        try:
            launch(_with_flight_recorder, job)
        except RankFailed as err:
            timed_out = "timed out" in str(err).lower()
            return {"what_happened": (f"timeout after {timeout_s:g} s" if timed_out
                                      else "failed without a timeout"),
                    "error": str(err), "stuck_in": where_it_waited(err.details, demo),
                    "timed_out": timed_out, "timeout_s": timeout_s,
                    "flight_recorder": {path.name: last_collectives(path)
                                        for path in sorted(Path(tmp).glob("rank_*"))},
                    "seconds_including_startup": time.perf_counter() - start}
    return {"what_happened": "finished: it did not hang", "timed_out": False,
            "seconds_including_startup": time.perf_counter() - start}


def _with_flight_recorder(ctx, args) -> None:
    """Each rank: run the demo; when its collective fails, save the flight recorder first."""
    try:
        args.demo(ctx, args)
    except RuntimeError:
        dump_flight_recorder(Path(args.flight_recorder_dir) / f"rank_{ctx.rank}")
        raise


@contextmanager
def flight_recorder_on(entries: int = 64) -> Iterator[None]:
    """A small TORCH_FR_BUFFER_SIZE for the ranks about to be started (the default, 2000, would
    do too); set here so that a reader's TORCH_FR_BUFFER_SIZE=0 cannot empty the demo."""
    before = os.environ.get("TORCH_FR_BUFFER_SIZE")
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(entries)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCH_FR_BUFFER_SIZE")
        else:
            os.environ["TORCH_FR_BUFFER_SIZE"] = before


def where_it_waited(details: str, demo: Callable) -> str:
    """The last line of ``demo``'s file in a traceback: where the failing rank was waiting."""
    script = Path(demo.__code__.co_filename).name
    lines = details.splitlines()
    here = [i for i, line in enumerate(lines) if script in line]
    if not here or here[-1] + 1 >= len(lines):
        return "unknown"
    i = here[-1]
    function = lines[i].rsplit(" in ", 1)[-1]
    code = lines[i + 1].split("  #", 1)[0].strip()  # without the comment
    return f"{function}(): {code}"

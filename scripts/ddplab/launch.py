"""Run one function on N ranks — the launcher every chapter uses.

``launch(worker, args)`` runs ``worker(ctx, args)`` on every rank and returns rank 0's result:

* ``python chapterNN_x.py`` — the script starts the ranks itself (``torch.multiprocessing.spawn``);
* ``torchrun --nproc-per-node N chapterNN_x.py`` — torchrun started the ranks and told each one
  who it is through the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

Both paths end in the same ``_run_rank``: pick the device, join the process group, seed, run,
and always leave the group again.  Things that go wrong end the whole run: a rank that raises is
reported once, with its rank and traceback, and the other ranks are stopped rather than left
waiting in a collective; a rank stuck in a collective gives up after ``--timeout`` seconds.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import pickle
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .cli import UsageError, show_warnings_as_one_line
from .ranks import RankContext, seed_everything
from .results import provenance

Worker = Callable[[RankContext, Any], Any]
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass
class Run:
    """What a launch gives back to the process that writes the chapter's files."""

    result: Any  # whatever rank 0's worker returned
    provenance: dict  # torch version, backend, device, world size, ... (see ddplab.results)


class RankFailed(Exception):
    """One rank raised or died; ``details`` holds that rank's traceback."""

    def __init__(self, rank: int, summary: str, details: str = ""):
        super().__init__(f"rank {rank} failed: {summary}")
        self.rank = rank
        self.details = details


def gpu_count() -> int:
    """CUDA GPUs this process can see (0 on a CPU build of torch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# --8<-- [start:choose_backend]
def choose_backend(requested: str, ranks_on_this_machine: int) -> str:
    """nccl when every rank on this machine can have a GPU of its own, else gloo on CPU."""
    gpus = gpu_count()
    if requested == "auto":
        enough_gpus = gpus >= ranks_on_this_machine and dist.is_nccl_available()
        return "nccl" if enough_gpus else "gloo"
    if requested == "nccl" and not dist.is_nccl_available():
        raise UsageError("--backend nccl: this torch build has no NCCL (a CPU build?); "
                         "use --backend gloo")
    if requested == "nccl" and gpus < ranks_on_this_machine:
        # Two ranks on one GPU is not supported by NCCL: say so before NCCL does, cryptically.
        hint = f"--world-size {gpus} or " if gpus > 1 else ""
        raise UsageError(f"--backend nccl needs one GPU per rank: {ranks_on_this_machine} ranks "
                         f"on this machine but {gpus} GPU(s) found; use {hint}--backend gloo")
    return requested
# --8<-- [end:choose_backend]


def default_world_size() -> int:
    """One rank per GPU when there are at least two GPUs, else two CPU processes."""
    gpus = gpu_count()
    return gpus if gpus >= 2 else 2


def usable_cores() -> int:
    """The cores this process may run on: a container or a job scheduler (Slurm, taskset) may
    allow fewer than ``os.cpu_count()``, which counts every core of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def started_by_torchrun() -> bool:
    return all(name in os.environ for name in _TORCHRUN_VARS)


def launch(worker: Worker, args) -> Run | None:
    """Run ``worker(ctx, args)`` on every rank; rank 0's result comes back as ``Run.result``.

    Under torchrun every rank runs this function itself: rank 0 gets the ``Run``, the other
    ranks get None (they have nothing left to do).
    """
    if getattr(args, "replot", False):  # a chapter without --replot must not run a whole run
        raise UsageError("this chapter cannot --replot yet: run it without --replot")
    if started_by_torchrun():
        return _launched_by_torchrun(worker, args)
    world_size = args.world_size or default_world_size()
    backend = choose_backend(args.backend, world_size)
    return _spawn(worker, args, world_size, backend)


# --- mp.spawn: this process starts the ranks -------------------------------------------------

@dataclass(frozen=True)
class _SpawnPlan:
    world_size: int
    backend: str
    store_port: int
    scratch: Path  # where ranks leave their result and error reports


def _spawn(worker: Worker, args, world_size: int, backend: str) -> Run:
    # The rendezvous is a key-value store the ranks meet at.  This process hosts it on a port
    # the OS picks (port 0), so two runs never fight over a port and nothing needs to be freed.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=args.timeout))
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # we report instead
    with tempfile.TemporaryDirectory(prefix="ddplab-") as scratch:
        plan = _SpawnPlan(world_size, backend, store.port, Path(scratch))
        try:
            mp.spawn(_spawned_rank, args=(worker, args, plan), nprocs=world_size, join=True)
        except mp.ProcessExitedException as err:
            raise _root_cause(plan.scratch, err.error_index, died=_how_it_died(err)) from None
        except mp.ProcessRaisedException as err:  # raised before it could report (e.g. in init)
            raise _root_cause(plan.scratch, err.error_index, raised=err.msg) from None
        with open(plan.scratch / "result.pkl", "rb") as f:
            return pickle.load(f)


def _spawned_rank(rank: int, worker: Worker, args, plan: _SpawnPlan) -> None:
    """Entry point of each spawned process (mp.spawn passes the process index as the rank)."""
    # The same variables torchrun would set, so code written for torchrun works unchanged.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(plan.world_size),
                      LOCAL_WORLD_SIZE=str(plan.world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(plan.store_port))
    store = dist.TCPStore("127.0.0.1", plan.store_port, plan.world_size, is_master=False,
                          timeout=timedelta(seconds=args.timeout))

    def report(err: BaseException, first: int | None) -> None:
        failure = {"rank": rank, "first": first, "summary": _one_line(err),
                   "traceback": "".join(traceback.format_exception(err))}
        (plan.scratch / f"error-rank{rank}.json").write_text(json.dumps(failure))

    run = _run_rank(worker, args, rank=rank, local_rank=rank, world_size=plan.world_size,
                    local_world_size=plan.world_size, backend=plan.backend,
                    launcher="mp.spawn", store=store, on_error=report)
    if run is not None:
        with open(plan.scratch / "result.pkl", "wb") as f:
            pickle.dump(run, f)
    exit_without_teardown(0)


def exit_without_teardown(code: int) -> None:
    """End a rank's process now that it has left the group and handed over its result.

    What a normal exit does first still happens: threads the worker left running (a writer
    thread, say) are waited for, and the ``atexit`` handlers run (they flush logs and release
    what ``multiprocessing`` made, such as tqdm's lock).  What is skipped is the teardown.  A
    rank's teardown can crash, rarely (one of this book's CI runs, none of dozens of runs by
    hand): ``terminate called without an active exception``, SIGABRT, after the work was done.
    Our reading, after pytorch#179291: a process group's C++ thread lets go of a tensor during
    the teardown and needs the GIL, which a shutting-down Python refuses by ending the thread,
    which C++ turns into ``std::terminate``.
    """
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _root_cause(scratch: Path, rank: int, *, died: str | None = None,
                raised: str = "") -> RankFailed:
    """Name the rank that failed first: the others usually failed *because* it went away."""
    reports = {r["rank"]: r for r in
               (json.loads(p.read_text()) for p in scratch.glob("error-rank*.json"))}
    if died is not None and rank not in reports:
        return RankFailed(rank, f"the process {died} (no Python traceback: killed, out of "
                                "memory, or a crash in native code)")
    first = next((r for r in reports.values() if r["first"] == r["rank"]), reports.get(rank))
    if first is not None and _is_follow_on(first["summary"]):
        # A rank's transport can close its sockets (a gloo timeout does) before that rank has
        # claimed the failure: prefer a rank whose own error is not "the peer went away".
        first = next((r for r in reports.values() if not _is_follow_on(r["summary"])), first)
    if first is None:  # mp.spawn's own message: the traceback, ending in 'Type: message'
        lines = raised.strip().splitlines()
        return RankFailed(rank, lines[-1] if lines else "failed with no error message", raised)
    return RankFailed(first["rank"], first["summary"], first["traceback"])


def _is_follow_on(summary: str) -> bool:
    return "Connection closed by peer" in summary or "Connection reset by peer" in summary


def _how_it_died(err: mp.ProcessExitedException) -> str:
    if err.signal_name:
        return f"was killed by {err.signal_name}"
    return f"exited with code {err.exit_code}"


# --- torchrun: torchrun started the ranks ----------------------------------------------------

def _launched_by_torchrun(worker: Worker, args) -> Run | None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if args.world_size is not None and args.world_size != world_size:
        raise UsageError(f"--world-size {args.world_size} does not match torchrun's {world_size} "
                         "processes; leave --world-size out under torchrun")
    backend = choose_backend(args.backend, local_world_size)
    first_failure: list[int | None] = []
    try:
        return _run_rank(worker, args, rank=rank, local_rank=int(os.environ["LOCAL_RANK"]),
                         world_size=world_size, local_world_size=local_world_size,
                         backend=backend, launcher="torchrun", store=None,
                         on_error=lambda err, first: first_failure.append(first))
    except Exception as err:
        first = first_failure[0] if first_failure else None
        if first is not None and first != rank:
            # A follow-on failure.  Say so in one line, then give torchrun a moment to stop us,
            # so that its summary names the rank that failed first as the root cause.
            print(f"[rank {rank}] stopped: rank {first} failed first (read its error)",
                  file=sys.stderr)
            time.sleep(_FOLLOW_ON_GRACE_S)
            raise SystemExit(1) from None
        raise RankFailed(rank, _one_line(err), "".join(traceback.format_exception(err))) from None


_FOLLOW_ON_GRACE_S = 5.0


# --- the part both launchers share ----------------------------------------------------------

# --8<-- [start:run_rank]
def _run_rank(worker: Worker, args, *, rank: int, local_rank: int, world_size: int,
              local_world_size: int, backend: str, launcher: str, store: dist.Store | None,
              on_error: Callable[[BaseException, int | None], None]) -> Run | None:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)  # one GPU per rank, chosen before any CUDA work
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        # N ranks sharing the cores: without this each rank starts one thread per core.
        torch.set_num_threads(max(1, usable_cores() // local_world_size))

    init = {"backend": backend, "rank": rank, "world_size": world_size,
            "timeout": timedelta(seconds=args.timeout)}
    init.update({"store": store} if store is not None else {"init_method": "env://"})
    if device.type == "cuda":
        init["device_id"] = device  # binds the NCCL communicator to this rank's GPU
    dist.init_process_group(**init)
    try:
        seed_everything(args.seed)  # same seed on every rank -> identical replicas
        ctx = RankContext(rank=rank, local_rank=local_rank, world_size=world_size,
                          backend=backend, device=device, seed=args.seed,
                          quick=args.quick, launcher=launcher)
        result = worker(ctx, args)
        return Run(result, provenance(ctx)) if ctx.is_main else None
    except BaseException as err:
        on_error(err, _claim_first_failure(store, rank, args.timeout))
        raise
    finally:
        dist.destroy_process_group()  # always leave the group, even after an error
# --8<-- [end:run_rank]


def _claim_first_failure(store: dist.Store | None, rank: int, timeout: float) -> int | None:
    """Atomically record 'rank failed' unless a rank already did; return who failed first.

    When one rank dies, its peers fail too ("Connection closed by peer").  The store's
    compare-and-set lets exactly one rank — the first — claim to be the cause.
    """
    try:
        if store is None:  # torchrun: its store listens at MASTER_ADDR:MASTER_PORT
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  is_master=False, timeout=timedelta(seconds=min(timeout, 5)))
        # torchrun may keep its store across restarts (--max-restarts): one key per attempt.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        first = store.compare_set(f"ddplab/first_failure/{attempt}", "", str(rank))
        return int(first)
    except Exception:  # the store itself is gone: we cannot tell who was first
        return None


def _one_line(err: BaseException) -> str:
    """'ValueError: first line of the message' — the line a reader sees last."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def run_main(main: Callable[[list[str] | None], Any], argv: list[str] | None = None) -> int:
    """Run a chapter's ``main`` and turn failures into one clear last line and an exit code."""
    show_warnings_as_one_line()
    try:
        main(argv)
    except RankFailed as err:
        if err.details:
            sys.stderr.write(f"\n--- traceback from rank {err.rank} ---\n{err.details}\n")
        print(f"error: {err}", file=sys.stderr)
        return 1
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    if started_by_torchrun():
        exit_without_teardown(0)  # this process is a rank: the same teardown risk as above
    return 0

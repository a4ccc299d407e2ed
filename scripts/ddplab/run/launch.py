"""Run one function on N ranks — the launcher every chapter uses.

``launch(worker, args)`` runs ``worker(ctx, args)`` on every rank and returns rank 0's result:

* ``python chapterNN_x.py`` — the script starts the ranks itself (``torch.multiprocessing``:
  spawned, or forked from a fork server, see ``fork_server``);
* ``torchrun --nproc-per-node N chapterNN_x.py`` — torchrun started the ranks and told each one
  who it is through the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

Both paths end in the same ``_run_rank``: pick the device, join the process group, seed, run,
and always leave the group again.  Things that go wrong end the whole run: a rank that raises is
reported once, with its rank and traceback, and the other ranks are stopped rather than left
waiting in a collective; a rank stuck in a collective gives up after ``--timeout`` seconds.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
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

from . import fork_server, stopping
from .cli import RANK_VARIABLES, UsageError, check_launcher_environment
from .devices import Placement, default_world_size, place, usable_cores
from .first_failure import Claim, a_cause_behind, claim_failure, is_follow_on, one_line
from .ranks import RankContext, seed_everything
from .results import provenance
from .stopping import exit_without_teardown

Worker = Callable[[RankContext, Any], Any]


@dataclass
class Run:
    """What a launch gives back to the process that writes the chapter's files."""

    result: Any  # whatever rank 0's worker returned
    provenance: dict  # torch version, backend, device, world size, ... (see ddplab.run.results)


class RankFailed(Exception):
    """One rank raised or died; ``details`` holds that rank's traceback."""

    def __init__(self, rank: int, summary: str, details: str = ""):
        super().__init__(f"rank {rank} failed: {summary}")
        self.rank = rank
        self.details = details


def started_by_torchrun() -> bool:
    return all(name in os.environ for name in RANK_VARIABLES)


def planned_world_size(args) -> int:
    """The world size this run will have, known before any rank starts."""
    if started_by_torchrun():
        check_launcher_environment()
        return int(os.environ["WORLD_SIZE"])
    return args.world_size or default_world_size()


def check_rank(flag: str, rank: int | None, args) -> None:
    """Reject a rank this run will not have (``--crash-rank 5`` with 2 ranks would do nothing)."""
    world = planned_world_size(args)
    if rank is not None and not 0 <= rank < world:
        raise UsageError(f"{flag} {rank}: this run has ranks 0..{world - 1}")


def launch(worker: Worker, args, *, start_method: str | None = None) -> Run | None:
    """Run ``worker(ctx, args)`` on every rank; rank 0's result comes back as ``Run.result``.

    Under torchrun every rank runs this function itself: rank 0 gets the ``Run``, the other
    ranks get None (they have nothing left to do).

    ``start_method`` is how this process starts its ranks: ``"spawn"``, a fresh interpreter
    per rank, or ``"forkserver"``, a fork of multiprocessing's fork server, which skips the
    rank's own import of torch when the server preloaded it.  By default a chapter script forks
    its CPU ranks on Linux and spawns the others (``fork_server``); elsewhere the default is
    spawn, and the tests that run ranks in their own process name the server they preloaded.
    """
    if getattr(args, "replot", False):  # a chapter without --replot must not run a whole run
        raise UsageError("this chapter cannot --replot yet: run it without --replot")
    if started_by_torchrun():
        check_launcher_environment()  # for a script that parses its own flags
        return _launched_by_torchrun(worker, args)
    world_size = args.world_size or default_world_size()
    placement = place(_device_flag(args), args.backend, world_size)
    return _spawn(worker, args, world_size, placement,
                  start_method or fork_server.start_method(placement.device_type))


def _device_flag(args) -> str:
    return getattr(args, "device", "auto")  # a script with its own parser may not have --device


# --- mp.spawn: this process starts the ranks -------------------------------------------------

@dataclass(frozen=True)
class _SpawnPlan:
    world_size: int
    placement: Placement
    store_port: int
    scratch: Path  # where ranks leave their result and error reports
    launcher_pid: int  # a forked rank's parent is the fork server: it watches this process


def _spawn(worker: Worker, args, world_size: int, placement: Placement,
           start_method: str) -> Run:
    # The rendezvous is a key-value store the ranks meet at.  This process hosts it on a port
    # the OS picks (port 0), so two runs never fight over a port and nothing needs to be freed.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=args.timeout))
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # we report instead
    with tempfile.TemporaryDirectory(prefix="ddplab-") as scratch:
        plan = _SpawnPlan(world_size, placement, store.port, Path(scratch), os.getpid())
        _start_helpers(start_method)
        ranks = None
        try:
            # A stop that comes while the ranks start is acted on once every rank is known
            # (and stopped, in finally): a rank started after it would be left behind.
            with stopping.stops_held():
                ranks = mp.start_processes(_spawned_rank, args=(worker, args, plan),
                                           nprocs=world_size, join=False,
                                           start_method=start_method)
            # On a failure, join gives the other ranks STOP_GRACE_S to end by themselves, then
            # SIGTERM and STOP_GRACE_S more, then SIGKILL: a frozen rank ends within
            # --timeout (a peer gives up) + 2 * STOP_GRACE_S.
            while not ranks.join(grace_period=stopping.STOP_GRACE_S):
                pass
        except mp.ProcessExitedException as err:
            _check_room(plan.scratch)
            raise _root_cause(plan.scratch, err.error_index, died=_how_it_died(err)) from None
        except mp.ProcessRaisedException as err:  # raised before it could report (e.g. in init)
            _check_room(plan.scratch)
            raise _root_cause(plan.scratch, err.error_index, raised=err.msg) from None
        except (EOFError, pickle.UnpicklingError):  # mp.spawn found a rank's report empty
            _check_room(plan.scratch)
            failed = next((i for i, p in enumerate(ranks.processes) if p.exitcode), 0)
            raise RankFailed(failed, "it failed, and its error report is empty") from None
        finally:  # also on Ctrl-C or SIGTERM here: no rank outlives this process
            if ranks is not None:
                stopping.stop_processes(ranks.processes)
                for path in ranks.error_files:  # mp.spawn's reports of a rank's error, in $TMPDIR
                    Path(path).unlink(missing_ok=True)
        with open(plan.scratch / "result.pkl", "rb") as f:
            return pickle.load(f)


def _start_helpers(start_method: str) -> None:
    """Start multiprocessing's helper processes before the ranks, with the stop signals not
    held: starting the resource tracker unblocks them, and a fork server started while they
    are held would keep them blocked for good."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    if start_method == "forkserver":
        fork_server.ensure_running()


def _spawned_rank(rank: int, worker: Worker, args, plan: _SpawnPlan) -> None:
    """Entry point of each spawned process (mp.spawn passes the process index as the rank)."""
    # Ctrl-C reaches every process of the terminal's group: the launching process stops the
    # ranks (at once, and with the last word); and if it dies, the kernel ends its ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The launching process stops a rank with SIGTERM: as an exception, so that what the rank
    # was writing (a checkpoint's temporary file) is removed on the way out.
    stopping.stop_on_sigterm()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stopping.STOP_SIGNALS)  # held by _spawn
    _end_with_parent()
    if os.getppid() != plan.launcher_pid:  # forked by the fork server
        fork_server.end_with(plan.launcher_pid)
    # The same variables torchrun would set, so code written for torchrun works unchanged.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(plan.world_size),
                      LOCAL_WORLD_SIZE=str(plan.world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(plan.store_port))
    store = dist.TCPStore("127.0.0.1", plan.store_port, plan.world_size, is_master=False,
                          timeout=timedelta(seconds=args.timeout))

    def report(err: BaseException, first: Claim | None) -> None:
        failure = {"rank": rank, "first": first.rank if first else None, "summary": one_line(err),
                   "traceback": "".join(traceback.format_exception(err))}
        (plan.scratch / f"error-rank{rank}.json").write_text(json.dumps(failure))

    try:
        run = _run_rank(worker, args, rank=rank, local_rank=rank, world_size=plan.world_size,
                        local_world_size=plan.world_size, placement=plan.placement,
                        launcher="mp.spawn", store=store, on_error=report)
    except stopping.Stopped as stop:  # the launching process reports the stop, not a rank
        exit_without_teardown(stop.exit_code)
    if run is not None:
        with open(plan.scratch / "result.pkl", "wb") as f:
            pickle.dump(run, f)
    exit_without_teardown(0)


def _end_with_parent() -> None:
    """SIGKILL this rank when the launching process dies (mp.spawn asks for SIGINT, which a
    rank busy in C++ or ignoring SIGINT would not act on).  Linux only; elsewhere a no-op."""
    set_pdeathsig = getattr(mp, "_prctl_pr_set_pdeathsig", None)
    if set_pdeathsig is not None:
        set_pdeathsig(signal.SIGKILL)


def _root_cause(scratch: Path, rank: int, *, died: str | None = None,
                raised: str = "") -> RankFailed:
    """Name the rank that failed first: the others usually failed *because* it went away."""
    reports = {r["rank"]: r for r in
               (json.loads(p.read_text()) for p in scratch.glob("error-rank*.json"))}
    if died is not None and rank not in reports:
        return RankFailed(rank, f"the process {died} (no Python traceback: killed, out of "
                                "memory, or a crash in native code)")
    first = next((r for r in reports.values() if r["first"] == r["rank"]), reports.get(rank))
    if first is not None and is_follow_on(first["summary"]):
        # A rank's transport can close its sockets (a gloo timeout does) before that rank has
        # claimed the failure: prefer a rank whose own error is not "the peer went away".
        first = next((r for r in reports.values() if not is_follow_on(r["summary"])), first)
    if first is None:  # mp.spawn's own message: the traceback, ending in 'Type: message'
        lines = raised.strip().splitlines()
        return RankFailed(rank, lines[-1] if lines else "failed with no error message", raised)
    return RankFailed(first["rank"], first["summary"], first["traceback"])


def _check_room(scratch: Path) -> None:
    """A rank that fails for want of space cannot write why either (its report, mp.spawn's
    error file, its result: all in the temporary directory).  Say that the disk is full
    (entry.run_main makes it one line) rather than blame the rank."""
    if shutil.disk_usage(scratch).free < _ROOM_FOR_REPORTS:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(scratch)) from None


_ROOM_FOR_REPORTS = 1 << 20  # an error report fits in far less


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
    placement = place(_device_flag(args), args.backend, local_world_size)
    claims: list[Claim | None] = []
    try:
        return _run_rank(worker, args, rank=rank, local_rank=int(os.environ["LOCAL_RANK"]),
                         world_size=world_size, local_world_size=local_world_size,
                         placement=placement, launcher="torchrun", store=None,
                         on_error=lambda err, first: claims.append(first))
    except Exception as err:
        first = claims[0] if claims else None
        if first is not None and first.rank != rank and not a_cause_behind(first, err):
            # A follow-on failure.  Say so in one line, then give torchrun a moment to stop us,
            # so that its summary names the rank that failed first as the root cause.
            print(f"[rank {rank}] stopped: rank {first.rank} failed first (read its error)",
                  file=sys.stderr)
            time.sleep(_FOLLOW_ON_GRACE_S)
            raise SystemExit(1) from None
        raise RankFailed(rank, one_line(err), "".join(traceback.format_exception(err))) from None


_FOLLOW_ON_GRACE_S = 5.0


# --- the part both launchers share ----------------------------------------------------------

_KEPT_UNTIL_EXIT: list = []  # process groups this rank has left, never to be freed

def _run_rank(worker: Worker, args, *, rank: int, local_rank: int, world_size: int,
              local_world_size: int, placement: Placement, launcher: str,
              store: dist.Store | None,
              on_error: Callable[[BaseException, Claim | None], None]) -> Run | None:
    device, backend = placement.device_for(local_rank), placement.backend
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this rank's GPU, chosen before any CUDA work
    else:
        # N ranks sharing the cores: without this each rank starts one thread per core.
        torch.set_num_threads(max(1, usable_cores() // local_world_size))

    init = {"backend": backend, "rank": rank, "world_size": world_size,
            "timeout": timedelta(seconds=args.timeout)}
    init.update({"store": store} if store is not None else {"init_method": "env://"})
    if backend == "nccl":
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
        if not isinstance(err, stopping.Stopped):  # stopped from outside: not a failure
            on_error(err, claim_failure(store, rank, err, args.timeout))
        raise
    finally:
        _KEPT_UNTIL_EXIT.append(dist.group.WORLD)  # see exit_without_teardown
        dist.destroy_process_group()  # always leave the group, even after an error

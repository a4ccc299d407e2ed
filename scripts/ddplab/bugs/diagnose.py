"""The diagnosis runs (full lab only): each bug again, this time under the tool that finds it.

* ``TORCH_DISTRIBUTED_DEBUG=INFO``: DDP's reducer errors name the parameters involved;
* ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: every collective is checked against the other ranks'
  first, so a mismatch is reported instead of hanging;
* ``torch.autograd.set_detect_anomaly``: an in-place error points at the forward line;
* the flight recorder (``TORCH_FR_BUFFER_SIZE``) and ``torchfrtrace``: the last collectives each
  rank entered, compared across ranks.  NCCL's watchdog dumps the record when a collective times
  out; gloo has no watchdog, so the ranks here dump it themselves, through a *private* call
  (``torch._C._distributed_c10d._dump_fr_trace``), after their timeout;
* ``py-spy dump``: the Python stack of a rank that is stuck, from outside the process;
* ``TORCH_CPP_LOG_LEVEL=INFO``: c10d's own log lines (here: the store failing to listen).
"""

from __future__ import annotations

import itertools
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from . import collectives, ddp_errors
from .catalog import BY_NAME
from .runner import error_lines, run_on_this_rank

PY_SPY_AFTER_S = 1.0  # when the watcher looks at the stuck ranks


@contextmanager
def environment(**variables: str):
    """Set environment variables for the ranks a launch starts (they inherit them)."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def lines_with(texts: list[str], *needles: str) -> list[str]:
    return [line.strip() for text in texts for line in text.splitlines()
            if any(n in line for n in needles)]


def info_worker(ctx, args) -> dict | None:
    """Under TORCH_DISTRIBUTED_DEBUG=INFO: the reducer's errors, with parameter names."""
    found = {}
    for name in ("unused_parameter", "checkpoint_twice"):
        mine = run_on_this_rank(BY_NAME[name], False, ctx, args.scratch)
        found[name] = lines_with(mine["error"] or [], "Parameter", "parameter indices")
    with _warnings() as caught, torch.autograd.detect_anomaly():
        try:
            ddp_errors.inplace_parameter_broken(ctx, None, args.scratch)
        except RuntimeError as err:
            found["inplace_parameter"] = error_lines(err, keep=1) + [
                line for w in caught for line in _anomaly_lines(str(w.message))]
    return found if ctx.is_main else None


def _anomaly_lines(message: str) -> list[str]:
    """'Error detected in XBackward0' and the forward line of our code it points at."""
    lines = message.splitlines()
    ours = [f"{a.strip()}  |  {b.strip()}" for a, b in itertools.pairwise(lines)
            if "ddp_errors.py" in a]
    return [lines[0].strip(), *ours[-1:]]


@contextmanager
def _warnings():
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def detail_worker(ctx, args) -> dict | None:
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL: the size mismatch, reported by every rank."""
    try:
        collectives.mismatched_shapes_broken(ctx, None, args.scratch)
        report = ["(no error)"]
    except RuntimeError as err:
        report = str(err).replace(").Collectives", ").\nCollectives").splitlines()
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, report)
    return {"mismatched_shapes": everyone} if ctx.is_main else None


def detail_ddp_worker(ctx, args) -> str | None:
    """Does DDP itself work under DETAIL here?  (In our runs on torch 2.13 + gloo it did not.)"""
    torch.nn.parallel.DistributedDataParallel(ddp_errors.mlp())
    return "DDP constructed and ran under DETAIL" if ctx.is_main else None


def hang_worker(ctx, args) -> dict | None:
    """The rank-0-only collective on the default group, under the flight recorder and py-spy.

    The launch's --timeout is short, so the hang ends; each rank then dumps its record.
    """
    pids: list = [None] * ctx.world_size
    dist.all_gather_object(pids, os.getpid())
    stacks: dict[int, list[str]] = {}
    if ctx.is_main and py_spy():
        watcher = threading.Thread(target=_spy_on, args=(pids, stacks), daemon=True)
        watcher.start()
    start = time.perf_counter()
    try:
        collectives.one_rank_collective_broken(ctx, None, args.scratch)
        error = None
    except RuntimeError as err:
        error = error_lines(err, keep=1)[0]
    seconds = time.perf_counter() - start
    trace = torch._C._distributed_c10d._dump_fr_trace()  # private: gloo has no watchdog to do it
    (Path(args.scratch) / f"rank_{ctx.rank}").write_bytes(trace)
    if not ctx.is_main:
        return None
    if py_spy():
        watcher.join(timeout=20)
    return {"error": error, "seconds": seconds, "py_spy": stacks,
            "py_spy_available": py_spy() is not None}


def py_spy() -> str | None:
    """py-spy on the PATH, or next to this Python (a virtual environment not activated)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def _spy_on(pids: list[int], stacks: dict) -> None:
    time.sleep(PY_SPY_AFTER_S)
    for rank, pid in enumerate(pids):
        try:
            out = subprocess.run([py_spy(), "dump", "--pid", str(pid)], capture_output=True,
                                 text=True, timeout=15).stdout
        except (OSError, subprocess.SubprocessError) as err:
            out = f"py-spy failed: {err}"
        frames = [line.strip() for line in out.splitlines() if line.startswith(" ")]
        stacks[rank] = frames[:5]  # innermost first: where this rank waits


def analyse_flight_record(folder: Path) -> dict:
    """Run torch's ``torchfrtrace`` on the dumps; return its verdict and each rank's last entry.

    torch 2.13's gloo dump names the default group '' in its ``pg_config`` but '0' in its
    entries, and torchfrtrace then stops with ``KeyError: ('0', 0)``; we add the missing name.
    """
    last = {}
    for dump in sorted(folder.glob("rank_*")):
        record = pickle.loads(dump.read_bytes())
        for name, desc in {tuple(e["process_group"]) for e in record["entries"]}:
            record["pg_config"].setdefault(name, {**record["pg_config"].get("", {}),
                                                  "name": name, "desc": desc})
        dump.write_bytes(pickle.dumps(record))
        entry = record["entries"][-1]
        last[dump.name] = (f"#{entry['collective_seq_id']} {entry['profiling_name']} "
                           f"sizes {entry['input_sizes']} from line {_our_line(entry)}")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                           str(folder)], capture_output=True, text=True, timeout=60)
    verdict = lines_with([proc.stdout, proc.stderr], "error msg", "has errors", "Error")
    return {"last_entry_per_rank": last, "torchfrtrace": verdict[:4],
            "torchfrtrace_exit_code": proc.returncode}


def _our_line(entry: dict) -> str:
    frames = [f for f in entry.get("frames", []) if "bugs" in f["filename"]]
    return f"{Path(frames[0]['filename']).name}:{frames[0]['line']}" if frames else "?"


def port_log() -> list[str]:
    """The store on a taken port, with TORCH_CPP_LOG_LEVEL=INFO: c10d's own log lines."""
    other_job = collectives.port_held_by_another_job()
    code = ("import torch.distributed as dist, datetime\n"
            f"dist.TCPStore('127.0.0.1', {other_job.getsockname()[1]}, 1, True, "
            "timeout=datetime.timedelta(seconds=5))")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "INFO"})
    finally:
        other_job.close()
    return [line for line in lines_with([proc.stderr], "c10d", "Exception raised from")
            if not line.startswith("frame")][:2]

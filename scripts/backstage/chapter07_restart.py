"""A run that dies and is restarted: torchrun --max-restarts 1, and the log a run leaves behind.

Chapter 07 kills a rank under ``torchrun --max-restarts 1`` and lets torchrun restart the whole
group, which resumes from its last checkpoint by itself.  This module holds what that
demonstration needs around the training itself:

* ``EventLog``/``read_log``: rank 0 appends one JSON line per event (boot, built, start, step,
  save, crash, done), flushed at once, so a run that dies leaves its history behind; each line
  carries torchrun's ``restart_count``, so attempts can be told apart; ``loss_series`` reads
  the losses back;
* ``run_torchrun_restart``: torchrun as a subprocess, bounded by a timeout, ended with all its
  ranks whatever happens, and torchrun's own words about the failure and the restart;
  ``restart_metrics``: what the restart cost (steps lost, seconds) and whether it was exact;
* ``crash_if_asked``: the crash itself, once, in the first attempt only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ddplab.run.devices import default_world_size
from ddplab.run.launch import RankFailed
from ddplab.run.ranks import RankContext
from ddplab.run.stopping import end_process_tree


def restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class EventLog:
    """Rank 0 appends one JSON line per event, so a run that dies leaves its history behind."""

    def __init__(self, path: Path, job: str, ctx: RankContext):
        self.path, self.job, self.ctx = path, job, ctx
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, any_rank: bool = False, **fields) -> None:
        if not (self.ctx.is_main or any_rank):
            return
        record = {"t": time.time(), "job": self.job, "attempt": restart_count(),
                  "launcher": self.ctx.launcher, "event": event, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def loss_series(log: list[dict], job: str, attempt: int | None = None) -> dict[int, float]:
    return {e["step"] - 1: e["loss"] for e in log if e["job"] == job and e["event"] == "step"
            and (attempt is None or e["attempt"] == attempt)}


def run_torchrun_restart(args, script: Path, crash_at: int, work: Path) -> dict:
    """torchrun --max-restarts 1 running ``script --train`` as a subprocess: rank N-1 is killed
    at step ``crash_at``, once; torchrun restarts the group, which resumes from its checkpoint."""
    run_dir = work / "restart"
    world = args.world_size or default_world_size()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(world), "--max-restarts", "1", str(script), "--train",
           "--ckpt-dir", str(run_dir), "--crash-at-step", str(crash_at),
           "--crash-how", "kill", "--seed", str(args.seed), "--backend", args.backend,
           "--timeout", str(args.timeout), "--out", str(work / "restart-out"),
           *(["--quick"] if args.quick else [])]
    # torch >= 2.5 shares torchrun's rendezvous store with the workers; a restarted rank can
    # read the dead attempt's addresses from it and fail to connect (pytorch/pytorch#135712).
    # TMPDIR inside the work directory: what torchrun leaves there goes when the work dir goes.
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TMPDIR": str(work / "tmp"),
           "LOGLEVEL": "INFO"}  # torchrun then also says when it restarts the group
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=4 * args.timeout)
    except subprocess.TimeoutExpired:
        raise RankFailed(world - 1, "the torchrun restart demonstration hung "
                                "(torchrun's output is above)", read_rest(proc)) from None
    finally:  # also on Ctrl-C, SIGTERM or an error here: torchrun and its ranks end with us
        end_process_tree(proc)
    if proc.returncode != 0:
        root = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", output, re.DOTALL)
        raise RankFailed(int(root.group(1)) if root else world - 1,
                                f"under torchrun (exit status {proc.returncode}); torchrun's "
                                "output is above", output[-4000:])
    final = torch.load(run_dir / "final.pt", weights_only=True)
    return {"final": final, "log": read_log(run_dir / "log.jsonl"), "started": started,
            "wall_s": time.time() - started, "torchrun_lines": torchrun_lines(output)}


def read_rest(proc: subprocess.Popen) -> str:
    """What a hung torchrun printed, once it and its ranks are ended."""
    end_process_tree(proc)
    return proc.communicate()[0][-4000:]  # communicate keeps what it read before the timeout


def torchrun_lines(output: str) -> list[str]:
    """torchrun's own words about the failure and the restart (without the log prefix)."""
    keep = ("failed (exitcode", "attempts left")
    return [line.split("] ", 1)[-1].split(" of binary")[0].strip()
            for line in output.splitlines() if any(k in line for k in keep)]


def restart_metrics(restart: dict, ref_params: torch.Tensor) -> dict:
    """What the restart cost and whether it resumed exactly (``ref_params``: the
    uninterrupted run's final parameters)."""
    log, final = restart["log"], restart["final"]
    crash = next(e for e in log if e["event"] == "crash")
    boot = next(e for e in log if e["event"] == "boot" and e["attempt"] == final["attempt"])
    resumed_step = final["resumed_from"]
    return {"max_abs_diff": (final["params"] - ref_params).abs().max().item(),
            "restarts": final["attempt"],  # TORCHELASTIC_RESTART_COUNT of the attempt that finished
            "attempts": sorted({e["attempt"] for e in log}),
            "crashed_at_step": crash["step"], "resumed_from_step": resumed_step,
            "lost_steps": crash["step"] - resumed_step,
            "restart_s": boot["t"] - crash["t"], "wall_s": restart["wall_s"],
            "replica_diff": final["replica_diff"], "torchrun_said": restart["torchrun_lines"]}


def crash_if_asked(ctx, job, step: int, resumed: bool, log) -> None:
    """The last rank dies at ``job.crash_at`` — only in a run that started from step 0 and in
    torchrun's first attempt, so that the restarted (or rerun) group gets past it."""
    if job.crash_at != step or ctx.rank != ctx.world_size - 1 or resumed or restart_count():
        return
    log.write("crash", step=step, rank=ctx.rank, how=job.crash_how, any_rank=True)
    if job.crash_how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # like the OOM killer: no exception, no cleanup
    raise RuntimeError(f"rank {ctx.rank} crashed on purpose at step {step}")

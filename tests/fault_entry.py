"""A small chapter-like script for the fault suite: the shared launcher and flags, and ranks that
misbehave on request.  ``python tests/fault_entry.py SCENARIO --out DIR [flags]``.

Each rank writes ``DIR/rankN.pid`` once it is up, so a test knows when to strike.

    spin      every rank all-reduces forever (a test interrupts it)
    freeze    rank 1 stops itself (SIGSTOP) before a barrier: rank 0 waits --timeout
    kill      rank 1 holds a multiprocessing lock (as tqdm does) and is SIGKILLed
    raise     rank 1 raises; rank 0 waits in a barrier
    outputs   no rank misbehaves; the launching process writes DIR/chapter99/{a.png,results.json}
    restart   chapter 07's torchrun --max-restarts demonstration alone (a test stops it)
    save      rank 0 checkpoints into DIR/ckpt; the checksum file's fsync never returns
              (DIR/saving appears then: a test stops the run there)
    big       rank 0 returns 8 MB (more than a tiny TMPDIR holds)
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import torch
import torch.distributed as dist

import ddplab


def worker(ctx: ddplab.RankContext, args):
    (Path(args.out) / f"rank{ctx.rank}.pid").write_text(str(os.getpid()))
    dist.barrier()
    if args.scenario == "spin":
        while True:
            dist.all_reduce(torch.ones(4))
            time.sleep(0.05)
    if ctx.rank == 1 and args.scenario == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    if ctx.rank == 1 and args.scenario == "kill":
        lock = multiprocessing.get_context("spawn").Lock()  # registered with the resource tracker
        lock.acquire()
        os.kill(os.getpid(), signal.SIGKILL)
    if ctx.rank == 1 and args.scenario == "raise":
        raise ValueError("rank 1 broke on purpose")
    if args.scenario == "save":
        save_and_stall(Path(args.out))
    dist.barrier()
    return bytes(8 << 20) if args.scenario == "big" else ctx.world_size


def save_and_stall(out: Path) -> None:
    """A checkpoint save that stalls after the checkpoint file is in place, while its checksum
    file is still a temporary file (the second fsync of the save)."""
    from ddplab import checkpoint as ck

    real_fsync, calls = os.fsync, []

    def fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:
            (out / "saving").write_text("")
            time.sleep(600)
        real_fsync(fd)

    if dist.get_rank() == 0:
        os.fsync = fsync  # this rank's process only
    ck.save_checkpoint({"w": torch.ones(1000)}, out / "ckpt", 1)


def main(argv=None):
    parser = ddplab.chapter_parser(__doc__, prog="chapter99_faults.py")
    parser.add_argument("scenario",
                        choices=("spin", "freeze", "kill", "raise", "outputs", "restart",
                                 "save", "big"))
    parser.add_argument("--draw", default="a.png", help="figure names to write, comma-separated")
    args = ddplab.parse_chapter_args(parser, argv)
    if args.scenario == "restart":
        return restart(args)
    run = ddplab.launch(worker, args)
    with ddplab.chapter_output(args.out, 99) as out:
        for name in args.draw.split(","):
            (out / name).write_bytes(b"png")
        ranks = run.result if isinstance(run.result, int) else len(run.result)
        ddplab.write_results(out, 99, {"ranks": ranks}, run.provenance)


def restart(args) -> None:
    """What chapter 07's main does around its torchrun demonstration: a temporary work
    directory, removed whatever happens, and torchrun started inside it."""
    import shutil

    import chapter07_checkpointing as chapter

    from backstage import chapter07_report, chapter07_restart

    args.ckpt_dir = None
    work, _ = chapter07_report.work_directory(args)
    try:
        chapter07_restart.run_torchrun_restart(args, chapter.SCRIPT, chapter.config(args).crash_at,
                                              work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(ddplab.run_main(main))

"""Chapter 07's launching process: what it does around the runs, not the runs themselves.

Where the runs keep their checkpoints (removed at the end if temporary), the checks on the
command line, the record each run hands back (``run_record``, on every rank), the costs of a
save and the rest of the uninterrupted run's results, the one-screen summary, and the file
``--train`` leaves behind.
The story (train, save, resume, crash, restart) stays in scripts/chapter07_checkpointing.py.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from backstage.chapter07_restart import loss_series
from ddplab import checkpoint, checkpoint_dcp
from ddplab import checkpoint_pitfalls as pitfalls
from ddplab.checkpoint_pitfalls import max_abs_diff
from ddplab.run import timing
from ddplab.run.cli import UsageError
from ddplab.run.launch import started_by_torchrun
from ddplab.run.replot import write_figure_data
from ddplab.run.timing import slowest_rank

SKIPPED_UNDER_TORCHRUN = "needs several launches; run with python (mp.spawn) for this part"
LOCK_NAME = ".ddplab-run.lock"  # in --ckpt-dir: who is writing checkpoints there


def check_args(args, steps: int) -> None:
    """Chapter 07's own checks on the command line (``steps``: the run's length)."""
    if args.world_size is not None and args.world_size < 2:
        raise UsageError("chapter 07 needs --world-size 2 or more (a rank must crash "
                         "while another one survives)")
    if args.train and args.ckpt_dir is None:
        raise UsageError("--train needs --ckpt-dir DIR (where checkpoints are kept)")
    if args.crash_at_step is not None and not args.train:
        raise UsageError("--crash-at-step goes with --train")
    if args.crash_at_step is not None and not 0 <= args.crash_at_step < steps:
        raise UsageError(f"--crash-at-step {args.crash_at_step}: the run has {steps} steps"
                         f"{' (--quick)' if args.quick else ''}, choose 0..{steps - 1}")
    if args.ckpt_dir is not None:
        check_directory_place(args.ckpt_dir)


def check_directory_place(directory: Path) -> None:
    """``--ckpt-dir`` must be a directory or not exist yet, below a directory (not a file)."""
    for place in (directory, *directory.parents):
        if place.exists():
            if not place.is_dir():
                what = "names a file" if place == directory else f"is below a file, {place}"
                raise UsageError(f"--ckpt-dir {directory} {what}: checkpoints need a directory; "
                                 "choose another --ckpt-dir")
            return


def checkpoint_directory_lock(args):
    """The lock on ``--ckpt-dir`` for this run (under torchrun rank 0 takes it: the ranks of
    one run share the directory), or nothing when there is no --ckpt-dir."""
    if args.ckpt_dir is None or (started_by_torchrun() and os.environ.get("RANK") != "0"):
        return nullcontext()
    return locked_directory(args.ckpt_dir)


@contextmanager
def locked_directory(directory: Path) -> Iterator[None]:
    """Hold ``directory`` for this run alone: two runs checkpointing into one directory would
    overwrite each other's checkpoints and final.pt, and both report success.

    ``flock``: the kernel releases the lock when the process ends, however it ends, so a
    killed run leaves no lock behind that would block the next one.  The file stays (removing
    it would race with a run that just opened it); it says who held it last.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise UsageError(f"cannot use --ckpt-dir {directory} ({err.strerror}); choose a "
                         "directory you can write to") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 300, 0).decode(errors="replace").strip() or "another run"
            raise UsageError(f"--ckpt-dir {directory} is in use by {holder}: wait until that "
                             "run ends, or choose another --ckpt-dir") from None
        since = datetime.now(timezone.utc).isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"the run with PID {os.getpid()} on {socket.gethostname()} since "
                      f"{since}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def work_directory(args) -> tuple[Path, bool]:
    """Where the runs keep their checkpoints, and whether to delete it at the end.

    Under torchrun every rank is its own process: they agree on a directory named after their
    common parent, the torchrun agent (one machine; several need a shared --ckpt-dir).
    """
    if args.ckpt_dir is not None:
        if args.ckpt_dir.exists() and any(p.name != LOCK_NAME for p in args.ckpt_dir.iterdir()):
            raise UsageError(f"--ckpt-dir {args.ckpt_dir} is not empty: the chapter "
                             "needs fresh runs (use --train to resume from it)")
        return args.ckpt_dir, False
    if started_by_torchrun():
        return Path(tempfile.gettempdir()) / f"ddplab-ch07-torchrun-{os.getppid()}", True
    return Path(tempfile.mkdtemp(prefix="ddplab-ch07-")), True


@contextmanager
def work_directory_for(args) -> Iterator[Path]:
    """``work_directory``, deleted at the end when it is a temporary one (under torchrun, by
    rank 0 only: the ranks share it)."""
    work, temporary = work_directory(args)
    try:
        yield work
    finally:
        if temporary and (not started_by_torchrun() or os.environ.get("RANK") == "0"):
            shutil.rmtree(work, ignore_errors=True)


def reference_metrics(config: dict, reference: dict, work: Path, world_size: int,
                      smaller) -> dict:
    """results.json's first part: the uninterrupted run, what a save costs, the pitfalls, then
    what loading bad input says (``smaller``: a model the checkpoint does not fit) and the
    atomic-save demo."""
    good = checkpoint.latest_checkpoint(work / "reference" / "torch")
    metrics = {"config": config,
               "uninterrupted": {"replica_diff": reference["replica_diff"]},
               **save_costs(reference, work, world_size),
               "pitfalls": reference["pitfalls"]}
    metrics["bad_input"] = pitfalls.bad_input_demo(good, work, smaller)
    metrics["corrupt_file_error"] = metrics["bad_input"]["corrupted"]
    metrics["atomic"] = pitfalls.atomic_crash_demo(work)
    return metrics


def run_record(ctx, model, losses, seen, saves, resumed) -> dict:
    """What a run hands back (collective): its parameters, how far the replicas differ, the
    losses and the samples every step saw (all ranks'), the saves' timings, where it resumed."""
    params = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    rank0 = params.clone()
    dist.broadcast(rank0, src=0)
    replica_diff = slowest_rank((params - rank0).abs().max().item())  # DDP keeps them equal
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, seen)
    return {"params": params.cpu(), "replica_diff": replica_diff, "losses": losses,
            "seen": {s: sorted(i for r in everyone for i in r[s]) for s in seen},
            "saves": saves, "load_ms": resumed["load_ms"] if resumed else None,
            "resumed_from": resumed["step"] if resumed else None}


def save_costs(reference: dict, work: Path, world_size: int) -> dict:
    """What saving cost in the uninterrupted run: torch.save's phases, sizes, and DCP's."""
    torch_saves = [s for s in reference["saves"] if "torch" in s]
    phases = {k: timing.median([s["torch_phases"][k] for s in torch_saves])
              for k in torch_saves[0]["torch_phases"]}
    save_ms = timing.median([s["torch"] for s in torch_saves])
    phases["prune_barrier"] = max(0.0, save_ms - sum(phases.values()))
    dcp_dir = checkpoint_dcp.list_distributed(work / "reference" / "dcp")[-1]
    dcp_mb = checkpoint_dcp.dcp_mb_per_rank(dcp_dir, world_size)
    dcp_ms = timing.median([s["dcp"] for s in reference["saves"]])
    return {"save_ms": save_ms, "save_phases_ms": phases,
            "checkpoint_mb": torch_saves[-1]["torch_bytes"] / 1e6,
            "dcp": {"save_ms": dcp_ms, "mb_per_rank": dcp_mb, "checkpoint_mb": sum(dcp_mb),
                    "save_verdict": dcp_save_verdict(dcp_ms, save_ms)}}


def dcp_save_verdict(dcp_ms: float, torch_ms: float) -> str:
    """DCP's save against torch.save's, in words: which one paused training longer here."""
    if dcp_ms > torch_ms:
        return (f"here its save took {dcp_ms / torch_ms:.2f} times as long as `torch.save`'s: "
                "spreading the writing did not pay")
    if dcp_ms < torch_ms:
        return (f"even so, here its save took {dcp_ms / torch_ms:.2f} times as long as "
                "`torch.save`'s: spreading the writing paid")
    return "here its save took exactly as long as `torch.save`'s"


def resumed_metrics(dcp: dict, resumed: dict, resumed_dcp: dict, crash_error: str,
                    ref_params: torch.Tensor) -> dict:
    """How exactly the rerun after the crash resumed (one file, and DCP: updates ``dcp``)."""
    dcp.update({"max_abs_diff": max_abs_diff(resumed_dcp["params"], ref_params),
                "resumed_from_step": resumed_dcp["resumed_from"],
                "load_ms": resumed_dcp["load_ms"]})
    return {"load_ms": resumed["load_ms"],
            "resume": {"max_abs_diff": max_abs_diff(resumed["params"], ref_params),
                       "resumed_from_step": resumed["resumed_from"], "crash_error": crash_error,
                       "replica_diff": resumed["replica_diff"]}}


def resume_curves(crash_log: list, resumed: dict, resumed_dcp: dict, restart_log: list) -> dict:
    """The loss curves resume.png draws: the crashed run's steps, then each resume's."""
    crashed = loss_series(crash_log, "crash")
    return {"crash (mp.spawn), then rerun": {**crashed, **resumed["losses"]},
            "resumed from DCP": {**crashed, **resumed_dcp["losses"]},
            # attempt 1's steps overwrite attempt 0's
            "torchrun restart": loss_series(restart_log, "train"),
            "forgot the sampler position": {**crashed, **resumed["forgot"]["sampler"]["losses"]},
            "forgot the RNG states": {**crashed, **resumed["forgot"]["rng"]["losses"]}}


def skip_under_torchrun(metrics: dict) -> None:
    """Under torchrun the parts that need several launches are marked skipped."""
    print(f"note: under torchrun, skipping the crash/rerun, DCP resume and restart: "
          f"{SKIPPED_UNDER_TORCHRUN}")
    for key in ("resume", "dcp", "restart"):
        metrics.setdefault(key, {})["skipped"] = SKIPPED_UNDER_TORCHRUN
    metrics["load_ms"] = None


def summarize(metrics: dict) -> str:
    lines = []
    for key in ("resume", "dcp", "restart"):
        part = metrics[key]
        if "max_abs_diff" in part:
            lines.append(f"{key:<8} max |Δparam| vs uninterrupted = {part['max_abs_diff']:.3g}"
                         f"  (resumed from step {part['resumed_from_step']})")
        else:
            lines.append(f"{key:<8} skipped: {part['skipped']}")
    if "restarts" in metrics["restart"]:
        lines.append(f"torchrun restarts: {metrics['restart']['restarts']}")
    load = "" if metrics["load_ms"] is None else f"load {metrics['load_ms']:.1f} ms, "
    lines.append(f"save {metrics['save_ms']:.1f} ms, {load}"
                 f"checkpoint {metrics['checkpoint_mb']:.2f} MB")
    lines.append(f"corrupted file: {metrics['corrupt_file_error']}")
    return "\n".join(lines)


def write_final(run, ckpt_dir: Path) -> None:
    """--train's end: rank 0 leaves final.pt in ``ckpt_dir`` and says how the run went (the
    other ranks, under torchrun, have no ``run``: nothing to do)."""
    if run is None:
        return None
    result = run.result
    torch.save({"params": result["params"], "replica_diff": result["replica_diff"],
                "resumed_from": result["resumed_from"], "attempt": result["attempt"]},
               ckpt_dir / "final.pt")
    start = result["resumed_from"]
    how = f"resumed from step {start}" if start is not None else "from step 0"
    if run.provenance["launcher"] == "torchrun":
        how += f", torchrun restart {result['attempt']}"
    print(f"trained to step {max(result['losses'], default=start or 0) + 1} ({how}); "
          f"final parameters in {ckpt_dir / 'final.pt'}")


def write_figure_files(folder: Path, metrics: dict, run) -> list[str]:
    """What resume.png and restart.png draw beyond results.json (a run with every part)."""
    parts = run.result
    if "restart" not in parts:
        return []
    write_figure_data(folder, "resume.json", parts["curves"])
    write_figure_data(folder, "restart.json", {k: parts["restart"][k] for k in ("log", "started")})
    return ["resume.json", "restart.json"]

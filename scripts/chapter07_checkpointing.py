"""Chapter 07 — checkpointing, and surviving a failure.

Trains a small model with native DistributedDataParallel and checkpoints it: rank 0 writes one
file atomically, or every rank writes its share with torch.distributed.checkpoint (DCP).  Then
it breaks things on purpose and checks that the training continues as if nothing happened:
a rank crashes and a rerun resumes; a rank is killed under torchrun --max-restarts 1, torchrun
restarts the group and it resumes by itself.  Each resumed run must end with the uninterrupted
run's parameters, bit for bit.  Last, the usual mistakes, each with the error it really gives.

Run it:
    python scripts/chapter07_checkpointing.py                   # 2 CPU ranks, started by mp.spawn
    python scripts/chapter07_checkpointing.py --quick           # < 1 minute (what the tests run)
    python scripts/chapter07_checkpointing.py --replot          # only redraw the figures
    make run-chapter07
    torchrun --standalone --nproc-per-node 2 scripts/chapter07_checkpointing.py
        # same code; skips what needs several launches (crash + rerun, DCP resume, restart)

Train on your own, kill rank 1 at step 120, let torchrun restart the group; it resumes by itself:
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 1 scripts/chapter07_checkpointing.py --train --ckpt-dir /tmp/ckpt \\
        --crash-at-step 120 --crash-how kill
The same with mp.spawn: the crash ends the run; the same command again resumes from /tmp/ckpt:
    python scripts/chapter07_checkpointing.py --train --ckpt-dir /tmp/ckpt --crash-at-step 120

Writes out/chapter07/{resume.png, restart.png, cost.png, resume.json, restart.json, results.json}
(or under --out DIR), the figures drawn from the JSON files by scripts/drawing/chapter07.py.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import ddplab
import drawing.chapter07
from backstage import chapter07_report as report
from backstage import chapter07_restart
from backstage.chapter07_restart import EventLog, restart_count
from ddplab import checkpoint, checkpoint_dcp
from ddplab import checkpoint_pitfalls as pitfalls
from ddplab.checkpoint_pitfalls import max_abs_diff
from ddplab.run.chapter_main import figures_only, run_chapter
from ddplab.run.cli import with_changes
from ddplab.run.timing import slowest_rank

CHAPTER = 7
SCRIPT = Path(__file__).resolve()


@dataclass(frozen=True)
class Config:
    samples: int  # training set size
    batch: int  # per rank
    steps: int  # optimizer steps in the whole run
    every: int  # checkpoint every N steps
    crash_at: int  # the step a rank dies at in the crash demonstrations
    hidden: int
    features: int = 32
    classes: int = 10
    keep_last: int = 3
    lr: float = 3e-3


QUICK = Config(samples=1024, batch=16, steps=48, every=10, crash_at=45, hidden=256)
FULL = Config(samples=4096, batch=32, steps=400, every=50, crash_at=290, hidden=1024)


@dataclass(frozen=True)
class Job:
    """One training run: where its checkpoints go, and what happens to it."""

    name: str
    run_dir: Path  # checkpoints in run_dir/torch and run_dir/dcp, events in run_dir/log.jsonl
    save: tuple[str, ...] = ("torch",)  # checkpoint formats written every cfg.every steps
    resume: str | None = None  # "torch" or "dcp": continue from the newest checkpoint, if any
    crash_at: int | None = None  # the last rank dies before this step (first attempt only)
    crash_how: str = "raise"  # "raise" an exception, or "kill" the process (SIGKILL)
    stop_at: int | None = None  # stop cleanly after this step (a preemption)
    forget: str | None = None  # a pitfall: "sampler", "rng", "loader_rng" or "buckets"


# --- the model, the data, one step ------------------------------------------------------------

def make_model(cfg: Config, hidden: int | None = None) -> nn.Module:
    h = hidden or cfg.hidden
    return nn.Sequential(nn.Linear(cfg.features, h), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(h, h), nn.ReLU(), nn.Dropout(0.1), nn.Linear(h, cfg.classes))


def make_dataset(cfg: Config, seed: int) -> TensorDataset:
    """Points labelled by a random linear teacher; the third column is the sample's index."""
    g = torch.Generator().manual_seed(seed + 12345)
    x = torch.randn(cfg.samples, cfg.features, generator=g)
    teacher = torch.randn(cfg.features, cfg.classes, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(cfg.samples, cfg.classes, generator=g)).argmax(1)
    return TensorDataset(x, y, torch.arange(cfg.samples))


# --8<-- [start:build]
def build(ctx: ddplab.RankContext, cfg: Config, job: Job):
    ddplab.seed_everything(ctx.seed)  # the same model on every rank, in every attempt
    model = make_model(cfg).to(ctx.device)
    model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    warmup = max(1, cfg.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / cfg.steps))))
    torch.manual_seed(ctx.seed + 1 + ctx.rank)  # dropout: each rank draws its own masks

    data = make_dataset(cfg, ctx.seed)
    sampler = checkpoint.ResumableSampler(data, num_replicas=ctx.world_size, rank=ctx.rank,
                                  shuffle=True, seed=ctx.seed, drop_last=True)
    # iter(DataLoader) draws a seed from the *global* generator unless it has its own:
    # a resumed run starts iterating at another step, and that draw would shift dropout.
    own = None if job.forget == "loader_rng" else torch.Generator()
    loader = DataLoader(data, batch_size=cfg.batch, sampler=sampler, drop_last=True,
                        generator=own)
    return model, optimizer, scheduler, sampler, loader
# --8<-- [end:build]


def train_step(model, optimizer, scheduler, x, y) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # DDP averages the gradients over the ranks during backward
    optimizer.step()
    scheduler.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # for the log: the loss of the whole global batch
    return mean / dist.get_world_size()


# --- what goes into a checkpoint, and how it comes back ---------------------------------------

# --8<-- [start:state]
def training_state(ctx, cfg, model, optimizer, scheduler, step: int, epoch: int, batch: int,
                   ) -> dict:
    """Everything the next step depends on.  Collective: it gathers every rank's generators."""
    return {
        "model": model.module.state_dict(),  # the unwrapped model: no "module." prefix
        "optimizer": optimizer.state_dict(),  # AdamW's moments and step counts
        "scheduler": scheduler.state_dict(),  # where the learning-rate schedule is
        "step": step,
        "epoch": epoch,  # with the sampler's seed, fixes the order of this epoch...
        "batch_in_epoch": batch,  # ...and how far into it we are
        "rng": checkpoint.gather_rng_states(ctx.device),  # one entry per rank
        "run": run_settings(ctx, cfg),  # what the run depends on: a resume must match it
    }
# --8<-- [end:state]


def run_settings(ctx, cfg: Config) -> dict:
    """The settings that change what a run computes (a resume with others would mix two runs)."""
    return {"seed": ctx.seed, "world_size": ctx.world_size, "config": asdict(cfg)}


def save(ctx, cfg: Config, job: Job, model, optimizer, scheduler, position) -> dict:
    """Write every format ``job`` asks for; returns rank 0's timings in milliseconds."""
    step, epoch, batch = position
    timings = {}
    if "torch" in job.save:
        start = time.perf_counter()
        state = training_state(ctx, cfg, model, optimizer, scheduler, step, epoch, batch)
        collected = time.perf_counter()
        report = checkpoint.save_checkpoint(state, job.run_dir / "torch", step,
                                            keep_last=cfg.keep_last)
        timings["torch"] = (time.perf_counter() - start) * 1e3
        if report is not None:
            timings["torch_phases"] = {"collect": (collected - start) * 1e3,  # incl. gather
                                       **{k: v * 1e3 for k, v in report.seconds.items()}}
            timings["torch_bytes"] = report.bytes
    if "dcp" in job.save:
        start = time.perf_counter()
        extra = {"scheduler": scheduler.state_dict(), "step": step, "epoch": epoch,
                 "batch_in_epoch": batch, "run": json.dumps(run_settings(ctx, cfg))}
        checkpoint_dcp.save_distributed(job.run_dir / "dcp", step, model, optimizer, extra,
                                        cfg.keep_last)
        timings["dcp"] = (time.perf_counter() - start) * 1e3
    return timings


# --8<-- [start:resume]
def resume(ctx, cfg, job: Job, model, optimizer, scheduler, example) -> dict | None:
    """Load the newest checkpoint of ``job.resume``'s kind into everything; None if there is none.

    Rank 0 picks the checkpoint and tells the others, so that all ranks load the same one.
    """
    path = checkpoint_dcp.newest_checkpoint(job.run_dir / job.resume, job.resume)  # rank 0 picks
    if path is None:
        return None
    if job.forget != "buckets":
        settle_ddp_buckets(model, example)  # see "Three or more ranks" below
    start = time.perf_counter()
    load = load_torch_save if job.resume == "torch" else load_dcp
    state = load(ctx, cfg, job, path, model, optimizer, scheduler)
    return {"path": path, "step": state["step"], "epoch": state["epoch"],
            "batch_in_epoch": state["batch_in_epoch"],
            "load_ms": slowest_rank((time.perf_counter() - start) * 1e3)}


def load_torch_save(ctx, cfg, job: Job, path: Path, model, optimizer, scheduler) -> dict:
    state = checkpoint.load_checkpoint(path)  # on the CPU; load_state_dict copies to the device
    checkpoint.check_same_run(state.get("run"), run_settings(ctx, cfg), path)  # same seed, ...
    checkpoint.load_model_state(model.module, state["model"], path)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if job.forget != "rng":
        checkpoint.restore_rng_states(state["rng"], ctx.device, path)
    return state
# --8<-- [end:resume]


def load_dcp(ctx, cfg, job: Job, path: Path, model, optimizer, scheduler) -> dict:
    template = {"scheduler": scheduler.state_dict(), "step": 0, "epoch": 0,
                "batch_in_epoch": 0, "run": ""}
    state = checkpoint_dcp.load_distributed(path, model, optimizer, template)
    checkpoint.check_same_run(json.loads(state["run"]), run_settings(ctx, cfg), path)
    scheduler.load_state_dict(state["scheduler"])
    return state


# --8<-- [start:settle]
def settle_ddp_buckets(model: DDP, example: torch.Tensor) -> None:
    """One throwaway backward, so that the first resumed step uses DDP's final bucket layout.

    DDP's first backward uses one bucket for every gradient; then DDP rebuilds its buckets in
    the order the gradients became ready.  With 3 or more ranks the ring sums each element in
    an order that depends on where it sits in the bucket, so the first step after a resume
    would differ from the uninterrupted run's step in the last bit.  The gradients are thrown
    away; the parameters, buffers, optimizer and generators are loaded afterwards.
    """
    model(example).sum().backward()
    model.zero_grad(set_to_none=True)
# --8<-- [end:settle]


# --- the training loop --------------------------------------------------------------------------

# --8<-- [start:train]
def train(ctx: ddplab.RankContext, cfg: Config, job: Job) -> dict:
    log = EventLog(job.run_dir / "log.jsonl", job.name, ctx)
    dist.barrier()
    log.write("boot")  # every rank is up
    model, optimizer, scheduler, sampler, loader = build(ctx, cfg, job)
    log.write("built")
    example = loader.dataset[0][0][None].to(ctx.device)  # one input, for settle_ddp_buckets
    resumed = resume(ctx, cfg, job, model, optimizer, scheduler, example) if job.resume else None
    step, epoch, batch = start_position(resumed, job)
    log.write("start", step=step, resumed_from=step if resumed else None)

    end = job.stop_at or cfg.steps
    losses, seen, saves = {}, {}, []
    while step < end:
        sampler.start_at(epoch, skip=batch * cfg.batch)  # the samples this rank already had
        for x, y, index in loader:
            chapter07_restart.crash_if_asked(ctx, job, step, resumed is not None, log)
            loss = train_step(model, optimizer, scheduler, x.to(ctx.device), y.to(ctx.device))
            losses[step], seen[step] = loss.item(), index.tolist()
            step, batch = step + 1, batch + 1
            log.write("step", step=step, loss=losses[step - 1])
            if step % cfg.every == 0:
                saves.append(save(ctx, cfg, job, model, optimizer, scheduler, (step, epoch, batch)))
                log.write("save", step=step)
            if step == end:
                break
        else:
            epoch, batch = epoch + 1, 0  # the epoch ran out: the next one has a new order
    log.write("done", step=step)
    return report.run_record(ctx, model, losses, seen, saves, resumed)
# --8<-- [end:train]


def start_position(resumed: dict | None, job: Job) -> tuple[int, int, int]:
    """(step, epoch, batch in epoch) to start from: the checkpoint's, or the very beginning."""
    if resumed is None:
        return 0, 0, 0
    batch = 0 if job.forget == "sampler" else resumed["batch_in_epoch"]  # the pitfall: the
    return resumed["step"], resumed["epoch"], batch  # resumed run starts its epoch over


# --- what each launch runs ----------------------------------------------------------------------

def config(args) -> Config:
    return QUICK if args.quick else FULL


def stage_reference(ctx, args) -> dict:
    """The uninterrupted run (both checkpoint formats, for their costs), then three pitfalls."""
    cfg, work = config(args), Path(args.work)
    result = train(ctx, cfg, Job("uninterrupted", work / "reference", save=("torch", "dcp")))
    model = build(ctx, cfg, Job("pitfalls", work / "pitfalls"))[0]
    where = work / "pitfalls"
    where.mkdir(parents=True, exist_ok=True)
    result["pitfalls"] = {"every_rank_saves": pitfalls.every_rank_saves(ctx, model, where),
                          "no_map_location": pitfalls.load_without_map_location(ctx, model, where),
                          "ddp_prefix": pitfalls.ddp_prefix(make_model(cfg), model)}
    return result


def stage_crash(ctx, args) -> None:
    cfg = config(args)
    train(ctx, cfg, Job("crash", Path(args.work) / "crash", save=("torch", "dcp"),
                        crash_at=cfg.crash_at))


def stage_resume(ctx, args) -> dict:
    """The rerun after the crash (a new set of processes), then the forgetful resumes."""
    cfg, work = config(args), Path(args.work)
    result = train(ctx, cfg, Job("resumed", work / "crash", resume="torch"))
    snapshot = work / "snapshot"  # a copy of the checkpoint the crash left behind
    result["forgot"] = {what: train(ctx, cfg, Job(f"forgot {what}", snapshot, resume="torch",
                                                  save=(), forget=what))
                        for what in ("sampler", "rng")}
    shared = work / "loader_rng"  # the DataLoader without its own generator: crash and resume
    reference = train(ctx, cfg, Job("loader_rng uninterrupted", shared / "a", save=(),
                                    forget="loader_rng"))
    train(ctx, cfg, Job("loader_rng first part", shared / "b", stop_at=cfg.crash_at,
                        forget="loader_rng"))
    resumed = train(ctx, cfg, Job("loader_rng resumed", shared / "b", resume="torch",
                                  forget="loader_rng"))
    result["forgot"]["loader_rng"] = {**resumed, "reference_params": reference["params"]}
    return result


def stage_buckets(ctx, args) -> dict:
    """With 3 ranks: resume with and without settling DDP's buckets first (in one launch)."""
    cfg, work = config(args), Path(args.work) / "buckets"
    reference = train(ctx, cfg, Job("3 ranks, uninterrupted", work / "a", save=()))
    train(ctx, cfg, Job("3 ranks, first part", work / "b", stop_at=cfg.crash_at))
    runs = {name: train(ctx, cfg, Job(f"3 ranks, {name}", work / "b", resume="torch", save=(),
                                      forget=forget))
            for name, forget in (("settled", None), ("not_settled", "buckets"))}
    return {"world_size": ctx.world_size, **{
        f"max_abs_diff_{name}": max_abs_diff(run["params"], reference["params"])
        for name, run in runs.items()}}


def stage_resume_dcp(ctx, args) -> dict:
    return train(ctx, config(args), Job("resumed (DCP)", Path(args.work) / "crash",
                                        save=("dcp",), resume="dcp"))


def stage_train(ctx, args) -> dict:
    """--train: one run that resumes from --ckpt-dir when it can (what torchrun restarts)."""
    job = Job("train", Path(args.ckpt_dir), resume="torch", crash_at=args.crash_at_step,
              crash_how=args.crash_how)
    result = train(ctx, config(args), job)
    result["attempt"] = restart_count()
    return result


STAGES = {"reference": stage_reference, "crash": stage_crash, "resume": stage_resume,
          "resume_dcp": stage_resume_dcp, "buckets": stage_buckets, "train": stage_train}


def worker(ctx: ddplab.RankContext, args):
    """Runs on every rank."""
    result = STAGES[args.stage](ctx, args)
    return result if ctx.is_main else None


def launch(args, stage: str, **changes):
    return ddplab.launch(worker, with_changes(args, stage=stage, **changes))


# --- the launching process: run every part, then report ---------------------------------------

def start(args) -> ddplab.Run | None:
    """Every part's runs; None when only training (--train), or in a non-zero rank."""
    with report.checkpoint_directory_lock(args):  # one run at a time per --ckpt-dir
        if args.train:  # one run, checkpoints in --ckpt-dir; rank 0 leaves final.pt there
            return report.write_final(launch(args, "train"), Path(args.ckpt_dir))
        with report.work_directory_for(args) as work:  # removed at the end unless --ckpt-dir
            return run_every_part(args, work)


def run_every_part(args, work: Path) -> ddplab.Run | None:
    cfg = config(args)
    run = launch(args, "reference", work=str(work))
    if run is None:
        return None
    reference, provenance = run.result, run.provenance
    ref_params = reference["params"]
    smaller = make_model(cfg, hidden=cfg.hidden // 2)  # a checkpoint of another model
    metrics = report.reference_metrics(asdict(cfg), reference, work, provenance["world_size"],
                                       smaller)  # with the bad-input and atomic-save demos
    curves = {"uninterrupted": reference["losses"]}
    if provenance["launcher"] == "torchrun":
        report.skip_under_torchrun(metrics)
        return ddplab.Run({"metrics": metrics, "curves": curves}, provenance)

    # Crash (rank N-1 raises at cfg.crash_at), then a new launch resumes from the checkpoint.
    try:
        launch(args, "crash", work=str(work))
        raise RuntimeError("the crash run was supposed to fail")
    except ddplab.RankFailed as err:
        crash_error = str(err)
    crash_log = chapter07_restart.read_log(work / "crash" / "log.jsonl")
    pitfalls.snapshot_latest(work / "crash" / "torch", work / "snapshot" / "torch")
    resumed = launch(args, "resume", work=str(work)).result
    resumed_dcp = launch(args, "resume_dcp", work=str(work)).result
    restart = chapter07_restart.run_torchrun_restart(args, SCRIPT, cfg.crash_at, work)
    # 3 ranks, where the order of a sum matters (gloo on CPU unless there are 3 GPUs)
    metrics["buckets"] = launch(args, "buckets", work=str(work), world_size=3, backend=(
        args.backend if torch.cuda.device_count() >= 3 else "gloo")).result
    metrics.update(report.resumed_metrics(metrics["dcp"], resumed, resumed_dcp, crash_error,
                                          ref_params))
    metrics["restart"] = chapter07_restart.restart_metrics(restart, ref_params)
    metrics["pitfalls"].update(pitfalls.forgetful_resumes(resumed, reference, ref_params))
    curves.update(report.resume_curves(crash_log, resumed, resumed_dcp, restart["log"]))
    return ddplab.Run({"metrics": metrics, "curves": curves, "restart": restart}, provenance)


def parse_args(argv: list[str] | None = None):
    parser = ddplab.chapter_parser(__doc__, prog="chapter07_checkpointing.py")
    parser.add_argument("--ckpt-dir", type=Path, default=None, metavar="DIR",
                        help="where checkpoints go (default: a temporary directory, removed at "
                             "the end; with --train: required)")
    parser.add_argument("--train", action="store_true",
                        help="only train (resuming from --ckpt-dir if it has a checkpoint)")
    parser.add_argument("--crash-at-step", type=int, default=None, metavar="K",
                        help="with --train: the last rank dies at step K (first attempt only)")
    parser.add_argument("--crash-how", choices=("raise", "kill"), default="raise",
                        help="raise an exception, or SIGKILL the process (default: raise)")
    args = ddplab.parse_chapter_args(parser, argv)
    report.check_args(args, config(args).steps)
    return args


def main(argv: list[str] | None = None) -> dict | None:
    return run_chapter(CHAPTER, parse_args(argv), start=start,
                       finish=lambda args, run: run.result["metrics"],
                       extras=report.write_figure_files, draw=drawing.chapter07.draw,
                       summarize=lambda metrics, run: report.summarize(metrics),
                       wrote=figures_only)


if __name__ == "__main__":
    sys.exit(ddplab.run_main(main))

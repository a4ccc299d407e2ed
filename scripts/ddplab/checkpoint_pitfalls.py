"""The ways a checkpoint goes wrong, each with the error it really gives.

Chapter 07 makes each mistake on purpose and records what the reader would see:

* inside the ranks: every rank saving to the same file (``every_rank_saves``), a checkpoint
  from GPU 0 loaded without ``map_location`` (``load_without_map_location``), the DDP
  wrapper's state_dict loaded into a plain model (``ddp_prefix``);
* from the launching process: a process killed half-way through a save
  (``atomic_crash_demo``), truncated, corrupted, incomplete and mismatched files
  (``bad_input_demo``), and what a resume that forgot the sampler's position, the generators
  or the DataLoader's own generator changes (``snapshot_latest`` keeps the checkpoint they
  resume from; ``forgetful_resumes`` compares them with the uninterrupted run).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint

SCRIPTS = Path(__file__).resolve().parents[1]  # scripts/, where ddplab lives


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# --8<-- [start:every_rank_saves]
def every_rank_saves(ctx, model, directory: Path) -> dict:
    """torch.save(state, path) on every rank: rank 0 reads the file back while rank 1 is
    half-way through writing the same bytes to it (we hold rank 1 there with a barrier)."""
    path = directory / "model.pt"
    state = {"model": model.module.state_dict()}
    buffer = io.BytesIO()
    torch.save(state, buffer)  # exactly the bytes torch.save(state, path) writes
    data = buffer.getvalue()
    if ctx.rank == 0:
        torch.save(state, path)  # rank 0 is done...
    dist.barrier()
    error = None
    with open(path, "wb") if ctx.rank == 1 else nullcontext() as writer:  # ...rank 1 truncates it
        if writer:
            writer.write(data[: len(data) // 2])
            writer.flush()
        dist.barrier()
        if ctx.rank == 0:
            try:
                torch.load(path, weights_only=True)
            except Exception as err:
                error = one_line(err)
        dist.barrier()
        if writer:
            writer.write(data[len(data) // 2:])
    return {"error": error}
# --8<-- [end:every_rank_saves]


_PRETEND_GPU = [False]  # while True, torch.save records every tensor as saved from cuda:0


def _register_pretend_tagger() -> None:
    """torch.save asks registered "taggers" where a storage lives; ours answers cuda:0."""
    if not getattr(_register_pretend_tagger, "done", False):
        torch.serialization.register_package(
            0, lambda storage: "cuda:0" if _PRETEND_GPU[0] else None, lambda s, loc: None)
        _register_pretend_tagger.done = True


# --8<-- [start:map_location]
def load_without_map_location(ctx, model, directory: Path) -> dict:
    """A checkpoint written by rank 0 from GPU 0, loaded on every rank with and without
    map_location.  On a CPU machine we write the same file a GPU would: its tensors say cuda:0."""
    path = directory / "from_gpu0.pt"
    if ctx.rank == 0:
        if ctx.device.type == "cuda":
            torch.save(model.module.state_dict(), path)  # really on cuda:0
        else:
            _register_pretend_tagger()
            _PRETEND_GPU[0] = True
            try:
                torch.save(model.module.state_dict(), path)
            finally:
                _PRETEND_GPU[0] = False
    dist.barrier()
    recorded = set()  # a map_location function sees where each tensor was saved from
    torch.load(path, weights_only=True, map_location=lambda s, loc: recorded.add(loc) or s)
    try:
        without = str(next(iter(torch.load(path, weights_only=True).values())).device)
    except Exception as err:
        without = one_line(err)
    with_ = str(next(iter(torch.load(path, weights_only=True,
                                     map_location=ctx.device).values())).device)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, {"rank": ctx.rank, "without": without, "with": with_})
    return {"saved_on": sorted(recorded), "ranks": everyone}
# --8<-- [end:map_location]


def ddp_prefix(plain: nn.Module, model) -> dict:
    """Saving the DDP wrapper's state_dict: every key gains "module." and ``plain``, the same
    model unwrapped, refuses it."""
    try:
        plain.load_state_dict(model.state_dict())
        torch_error = None
    except RuntimeError as err:
        torch_error = " ".join(str(err).split())[:240]
    try:
        checkpoint.load_model_state(plain, model.state_dict(), Path("ddp_state.pt"))
        ours = None
    except checkpoint.CheckpointError as err:
        ours = str(err)
    return {"torch_error": torch_error, "our_error": ours}


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    first = text.split(". ")[0] if text else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def atomic_crash_demo(work: Path) -> dict:
    """A process killed between writing the temporary file and renaming it."""
    directory = work / "atomic"
    code = ("import os, signal, sys, torch; from ddplab import checkpoint; "
            "d = sys.argv[1]; checkpoint.save_checkpoint({'w': torch.ones(1000)}, d, step=1); "
            "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL); "
            "checkpoint.save_checkpoint({'w': torch.zeros(1000)}, d, step=2)")
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
    proc = subprocess.run([sys.executable, "-c", code, str(directory)], env=env,
                          capture_output=True, text=True, timeout=120)
    latest = checkpoint.latest_checkpoint(directory)
    state = checkpoint.load_checkpoint(latest)
    return {"exit_code": proc.returncode, "files": sorted(p.name for p in directory.iterdir()),
            "latest": latest.name, "latest_loads": bool(state["w"].eq(1).all())}


def bad_input_demo(good: Path, work: Path, smaller: nn.Module) -> dict:
    """Each broken checkpoint gets one clear line (paths shown relative to the work dir).
    ``smaller``: the model with other shapes (a checkpoint of another run)."""
    bad = work / "bad"
    messages = {}

    def copy(name: str, data: bytes, checksum: bool = True) -> Path:
        path = bad / name / good.name
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        if checksum:
            shutil.copy2(checkpoint.checksum_path(good), checkpoint.checksum_path(path))
        return path

    def message(action) -> str:
        try:
            action()
        except checkpoint.CheckpointError as err:
            return str(err).replace(f"{work}/", "")
        return "no error"

    data = good.read_bytes()
    weight = torch.load(good, weights_only=True)["model"]["0.weight"]
    at = data.find(weight.numpy().tobytes()[:64]) + 101  # a byte inside the first weight matrix
    flipped = bytearray(data)
    flipped[at] ^= 0xFF
    cpu = torch.device("cpu")
    truncated = copy("truncated", data[: len(data) // 2])
    corrupted = copy("corrupted", bytes(flipped))
    incomplete = copy("incomplete", data, checksum=False)
    messages["truncated"] = message(lambda: checkpoint.load_checkpoint(truncated, cpu))
    messages["corrupted"] = message(lambda: checkpoint.load_checkpoint(corrupted, cpu))
    messages["incomplete"] = message(lambda: checkpoint.load_checkpoint(incomplete, cpu))
    messages["missing_dir"] = message(lambda: checkpoint.list_checkpoints(work / "no_such_dir"))
    state = checkpoint.load_checkpoint(good, cpu)
    messages["wrong_shape"] = message(lambda: checkpoint.load_model_state(
        smaller, state["model"], good.relative_to(work)))
    silently = torch.load(corrupted, weights_only=True)["model"]["0.weight"]  # no checksum check
    messages["torch_load_alone_changed_weight_by"] = max_abs_diff(silently, weight)
    try:
        torch.load(truncated, weights_only=True)
        messages["torch_load_alone_truncated"] = "no error"
    except Exception as err:
        messages["torch_load_alone_truncated"] = one_line(err)
    return messages


def snapshot_latest(source: Path, target: Path) -> Path:
    """Copy the newest checkpoint (and its checksum) aside, for the forgetful resumes."""
    latest = checkpoint.latest_checkpoint(source)
    target.mkdir(parents=True, exist_ok=True)
    for path in (latest, checkpoint.checksum_path(latest)):
        shutil.copy2(path, target / path.name)
    return latest


def forgetful_resumes(resumed: dict, reference: dict, ref_params: torch.Tensor) -> dict:
    out = {}
    sampler, rng = resumed["forgot"]["sampler"], resumed["forgot"]["rng"]
    start = sampler["resumed_from"]
    visits = {}  # how often each sample was trained on, minus the uninterrupted run's count
    for step, indices in reference["seen"].items():
        for i in indices:
            visits[i] = visits.get(i, 0) - (step >= start)
    for indices in sampler["seen"].values():
        for i in indices:
            visits[i] = visits.get(i, 0) + 1
    changed = sum(sampler["seen"][s] != reference["seen"][s] for s in sampler["seen"])
    out["forgot_sampler"] = {"max_abs_diff": max_abs_diff(sampler["params"], ref_params),
                             "batches_after_resume": len(sampler["seen"]),
                             "batches_different": changed,
                             "samples_seen_more_often": sum(v > 0 for v in visits.values()),
                             "samples_seen_less_often": sum(v < 0 for v in visits.values())}
    out["forgot_rng"] = {"max_abs_diff": max_abs_diff(rng["params"], ref_params)}
    loader = resumed["forgot"]["loader_rng"]
    out["loader_without_generator"] = {
        "max_abs_diff": max_abs_diff(loader["params"], loader["reference_params"])}
    return out

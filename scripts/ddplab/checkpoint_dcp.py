"""``torch.distributed.checkpoint`` (DCP): every rank writes its share of one checkpoint.

DCP writes a directory: one ``__<rank>_<n>.distcp`` file per rank, then ``.metadata``.  It has
no checksum: a flipped byte in a shard loads silently.  So this module gives DCP checkpoints the
guarantee ``ddplab.checkpoint`` gives single files: after DCP's save (which ends with a
collective: every shard and ``.metadata`` are on disk), rank 0 hashes every file into
``checksums.sha256`` — the commit record — and a load checks every file against it first.

DCP also needs no process group to *read* a checkpoint: ``dcp.load(..., no_dist=True)`` loads it
in one process, a notebook say (torch/distributed/checkpoint/state_dict_loader.py, ``load``).

``newest_checkpoint`` picks the checkpoint to resume from, of either kind, the same on every rank.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import (
    PREFIX,
    CheckpointError,
    _fsync_directory,
    _sha256,
    _write_text_atomically,
    checkpoint_name,
    list_checkpoints,
    read_record,
    rng_state,
    set_rng_state,
)

MANIFEST = "checksums.sha256"  # sha256sum's format: `sha256sum -c checksums.sha256` checks it


# --8<-- [start:dcp_save]
def save_distributed(directory: Path, step: int, model, optimizer, extra: dict,
                     keep_last: int = 3) -> Path:
    """DCP: every rank calls this; each writes part of ``directory/step_NNNNNNN/``. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(directory) / checkpoint_name(step).removesuffix(".pt")
    model_state, optim_state = get_state_dict(model, optimizer)  # DDP's "module." removed
    rank = dist.get_rank()
    state = {"model": model_state, "optimizer": optim_state, "extra": extra,
             "rng": every_ranks_rng(_device_of(model))}  # the same keys on every rank
    if rank == 0:  # saving a step again: it is not complete until hashed again
        (path / MANIFEST).unlink(missing_ok=True)
    dcp.save(state, checkpoint_id=path)  # ends with a collective: every file is written
    if rank == 0:
        write_manifest(path)  # the commit record, last
        for old in list_distributed(Path(directory))[:-keep_last]:
            (old / MANIFEST).unlink()  # first the commit record
            shutil.rmtree(old)
    dist.barrier()
    return path
# --8<-- [end:dcp_save]


# --8<-- [start:dcp_load]
def load_distributed(path: Path, model, optimizer, extra: dict) -> dict:
    """Load in place into ``model``, ``optimizer`` and this rank's generators; returns ``extra``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    verify_manifest(Path(path))  # every rank checks every file: all ranks fail together
    device = _device_of(model)
    model_state, optim_state = get_state_dict(model, optimizer)  # the tensors to load into
    state = {"model": model_state, "optimizer": optim_state, "extra": dict(extra),
             "rng": [rng_state(device) for _ in range(dist.get_world_size())]}  # as saved
    try:
        dcp.load(state, checkpoint_id=path)
    except BaseException as err:  # DCP's CheckpointException derives from BaseException
        raise CheckpointError(f"{path} cannot be loaded ({_dcp_cause(err)})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    set_rng_state(state["rng"][dist.get_rank()], device)
    return state["extra"]
# --8<-- [end:dcp_load]


def every_ranks_rng(device: torch.device) -> list[dict]:
    """Every rank's generator states, as one list indexed by rank, on every rank.

    ``dcp.load`` needs the same keys on every rank ("mismatched keys may result in hangs or
    errors", its docstring), so a key per rank will not do; and a value saved under one key by
    every rank is taken as replicated and written once.  A list gathered from all ranks is both:
    the same keys, the same value.  Loading needs the same world size as saving."""
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state(device))
    return states


def write_manifest(path: Path) -> None:
    """Hash every file DCP wrote (shards and .metadata) into ``path/checksums.sha256``."""
    files = sorted(f for f in path.iterdir() if f.is_file() and f.name != MANIFEST)
    lines = "".join(f"{_sha256(f)}  {f.name}\n" for f in files)
    _write_text_atomically(path / MANIFEST, lines)
    _fsync_directory(path)


def verify_manifest(path: Path) -> None:
    """One clear line naming the first file that is missing, cut short or changed."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{path} has no {MANIFEST}: it was never completely written; "
                              "resume from an earlier checkpoint")
    text = read_record(manifest, f"delete {path} to resume from the previous checkpoint")
    entries = [line.split() for line in text.splitlines() if line.strip()]
    if not entries or any(len(e) != 2 for e in entries):
        raise CheckpointError(f"{manifest} is empty or damaged: delete {path} to resume from "
                              "the previous checkpoint")
    for digest, name in entries:
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"{shard} is missing (listed in {MANIFEST}); delete {path} "
                                  "to resume from the previous checkpoint")
        if _sha256(shard) != digest:
            raise CheckpointError(f"{shard} is truncated or corrupted ({shard.stat().st_size} "
                                  f"bytes, SHA-256 does not match {MANIFEST}); delete {path} to "
                                  "resume from the previous checkpoint")


def _dcp_cause(err: BaseException) -> str:
    """The first rank's own error inside DCP's CheckpointException, as one line."""
    failures = getattr(err, "failures", None)
    if failures:
        rank, (cause, _) = min(failures.items())
        err = cause
        prefix = f"rank {rank}: "
    else:
        prefix = ""
    lines = str(err).strip().splitlines()
    return f"{prefix}{type(err).__name__}: {lines[0][:160] if lines else ''}"


def list_distributed(directory: Path) -> list[Path]:
    """Complete DCP checkpoints (those with a checksum manifest), oldest first."""
    if not Path(directory).is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist: check the path, "
                              "or start without resuming")
    return sorted(p for p in Path(directory).glob(f"{PREFIX}*") if (p / MANIFEST).is_file())


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def dcp_mb_per_rank(directory: Path, world: int) -> list[float]:
    """DCP files are named __<rank>_<n>.distcp; rank 0 also writes .metadata."""
    sizes = [0] * world
    for f in directory.iterdir():
        if f.name == ".metadata" or f.suffix == ".distcp":
            rank = 0 if f.name == ".metadata" else int(f.name.split("_")[2])
            sizes[rank] += f.stat().st_size / 1e6
    return sizes


def newest_checkpoint(directory: Path, kind: str) -> Path | None:
    """Rank 0's newest complete checkpoint of ``kind`` ("torch": one file, or "dcp"), the same
    on every rank (a broadcast)."""
    directory.mkdir(parents=True, exist_ok=True)
    found = (list_checkpoints if kind == "torch" else list_distributed)(directory)
    choice = [found[-1] if found else None]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]

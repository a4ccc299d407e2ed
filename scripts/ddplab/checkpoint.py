"""Checkpoints for data-parallel training: written atomically on rank 0, resumed exactly.

Two ways to save, one contract: after a resume the next step computes exactly what it would
have computed without the interruption.

* ``save_checkpoint`` / ``load_checkpoint``: every rank holds the same model (that is what
  data parallelism means), so rank 0 alone writes one ``torch.save`` file.  The file appears
  under its final name only when it is complete (temporary file, fsync, ``os.replace``), and a
  SHA-256 beside it is the commit record: a checkpoint without one was never finished.
* ``checkpoint_dcp``: the same with ``torch.distributed.checkpoint`` (DCP), where every rank
  writes its share into a directory.

What "everything" means (model, optimizer, scheduler, position in the data, every random
generator) is the training loop's business; this module stores what it is given, and captures
the random generators, which are per rank.
"""

from __future__ import annotations

import hashlib
import os
import random
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from .run.timing import Laps

PREFIX = "step_"


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line: what is wrong, what to do."""


@dataclass
class SaveReport:
    """What a save cost, measured on rank 0 (``seconds`` maps phase -> seconds)."""

    path: Path
    bytes: int
    seconds: dict[str, float] = field(default_factory=dict)


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:07d}.pt"  # zero-padded: names sort in step order


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


# --- random generators: one state per rank ---------------------------------------------------

def rng_state(device: torch.device) -> dict:
    """This rank's generators: torch CPU, CUDA (on GPU), Python's ``random``, numpy's."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = (kind, keys.tolist(), pos, has_gauss, gauss)  # plain types: weights_only
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


# --8<-- [start:rng]
def gather_rng_states(device: torch.device) -> list[dict] | None:
    """Every rank's generator states, gathered on rank 0 (None elsewhere). Collective.

    They differ between ranks whenever ranks draw differently (dropout, augmentation), so
    saving rank 0's state for everybody would change every other rank's random numbers.
    """
    mine = rng_state(device)
    if not dist.is_initialized():
        return [mine]
    states = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, states, dst=0)
    return states


def restore_rng_states(states: list[dict], device: torch.device, source: Path) -> None:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if len(states) != world:
        raise CheckpointError(f"{source} was saved by {len(states)} ranks, this run has {world}: "
                              "an exact resume needs the same world size")
    set_rng_state(states[rank], device)
# --8<-- [end:rng]


# --- the position in the data -----------------------------------------------------------------

# --8<-- [start:sampler]
class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start part-way through an epoch.

    ``set_epoch`` alone restarts the epoch from its first batch; a resumed run would see those
    batches twice and never reach the last ones.  ``start_at(epoch, skip)`` skips the samples
    this rank already trained on.
    """

    skip = 0

    def start_at(self, epoch: int, skip: int) -> None:
        self.set_epoch(epoch)  # the epoch's shuffle is seeded by (seed, epoch): same order
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        return islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return max(0, self.num_samples - self.skip)
# --8<-- [end:sampler]


# --- one file, written by rank 0 ----------------------------------------------------------------

# --8<-- [start:save]
def save_checkpoint(state: dict, directory: Path, step: int, keep_last: int = 3,
                    ) -> SaveReport | None:
    """Rank 0 writes ``state`` to ``directory/step_NNNNNNN.pt``; every rank waits until it is done.

    Call it on every rank, with the same ``step``.  Returns rank 0's SaveReport (None elsewhere).
    """
    report = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        report = _write_atomically(state, Path(directory), step)
        _prune(Path(directory), keep_last)
    if dist.is_initialized():
        dist.barrier()  # nobody runs ahead (or resumes) before the checkpoint exists
    return report
# --8<-- [end:save]


# --8<-- [start:write]
def _write_atomically(state: dict, directory: Path, step: int) -> SaveReport:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(step)
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"  # same directory: same file system
    clock, digest = Laps(), None
    try:
        with open(tmp, "wb") as f:
            digest = _HashingWriter(f)
            torch.save(state, digest)
            clock.lap("write")  # torch.save into the page cache, hashing on the way
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
            clock.lap("fsync")
        checksum_path(final).unlink(missing_ok=True)  # saving a step again: no stale record
        os.replace(tmp, final)  # atomic: the old directory entry, or the complete new file
        _write_text_atomically(checksum_path(final), f"{digest.hexdigest()}  {final.name}\n")
        _fsync_directory(directory)  # make the renames themselves durable
        clock.lap("rename")
    except BaseException as err:
        tmp.unlink(missing_ok=True)  # a crash (SIGKILL, power) can still leave it: it is ignored
        clear = _disk_full(err, digest, final)
        if clear is None:
            raise
        raise clear from None
    return SaveReport(final, final.stat().st_size, clock.laps)
# --8<-- [end:write]


def _disk_full(err: BaseException, writer, final: Path) -> CheckpointError | None:
    """A failed write as one clear line.  torch.save turns the OSError (disk full, file too
    large) into 'unexpected pos ...'; the writer kept the original."""
    disk = err if isinstance(err, OSError) else getattr(writer, "error", None)
    if disk is None:
        return None
    return CheckpointError(f"cannot write {final}: {disk.strerror}; free some space or "
                           "checkpoint somewhere else (the previous checkpoint is intact)")


class _HashingWriter:
    """A file object for torch.save that hashes the bytes on their way to the file."""

    def __init__(self, f):
        self._f = f
        self._sha = hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data) -> int:
        self._sha.update(data)
        try:
            return self._f.write(data)
        except OSError as err:  # torch.save turns it into 'unexpected pos ...': keep it
            self.error = err
            raise

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def _write_text_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, Ctrl-C, SIGTERM: no half-written record left
        tmp.unlink(missing_ok=True)
        raise


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(directory: Path, keep_last: int) -> None:
    for old in list_checkpoints(directory)[:-keep_last]:
        checksum_path(old).unlink()  # first the commit record: a half-deleted one is not listed
        old.unlink()


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (those with a checksum file), oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist: check the path, "
                              "or start without resuming")
    return sorted(p for p in directory.glob(f"{PREFIX}*.pt") if checksum_path(p).is_file())


def latest_checkpoint(directory: Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


# --8<-- [start:load]
def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict:
    """Check the file against its SHA-256, then load it, by default with every tensor on the CPU.

    ``model.load_state_dict`` and ``optimizer.load_state_dict`` copy each tensor to its
    parameter's device anyway; the optimizer's ``step`` counters stay where they are loaded
    (torch/optim/optimizer.py, ``_process_value_according_to_param_policy``), and on the CPU
    reading them costs no GPU synchronization at every step.
    """
    path = Path(path)
    verify_checksum(path)  # one clear line if it is missing, unfinished, cut short or changed
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # a file whose checksum matches but torch cannot read
        first = str(err).strip().split("\n")[0][:160]
        raise CheckpointError(f"{path} cannot be loaded ({type(err).__name__}: {first})") from None
# --8<-- [end:load]


def verify_checksum(path: Path) -> None:
    """Raise a one-line CheckpointError unless ``path`` is a complete, unchanged torch.save file."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    record = checksum_path(path)
    if not record.is_file():
        raise CheckpointError(f"{path} has no {record.name}: it was never completely written; "
                              "resume from an earlier checkpoint")
    expected = read_record(record, f"delete it and {path.name} to resume from the previous "
                                   "checkpoint").split()
    if not expected:
        raise CheckpointError(f"{record} is empty: the save was cut off; delete it and "
                              f"{path.name} to resume from the previous checkpoint")
    if _sha256(path) != expected[0]:
        raise CheckpointError(f"{path} is truncated or corrupted ({path.stat().st_size} bytes, "
                              f"SHA-256 does not match {record.name}); delete both files to "
                              "resume from the previous checkpoint")
    if not zipfile.is_zipfile(path):  # torch.save has written zip archives since torch 1.6
        raise CheckpointError(f"{path} is not a torch.save file (its checksum matches: it was "
                              "written so, not damaged on the way); check what wrote it")


def read_record(record: Path, what_to_do: str) -> str:
    """A checksum file's text; a byte that is not UTF-8 (a damaged or foreign file) is one
    clear line naming the file, not a UnicodeDecodeError."""
    try:
        return record.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{record} is damaged (byte {err.start} is not text, so it is "
                              f"not a SHA-256 record): {what_to_do}") from None


def check_same_run(saved: dict | None, current: dict, source: Path) -> None:
    """Refuse to resume a run with other settings (seed, model size, ...): it would mix two runs."""
    for key, value in current.items():
        was = (saved or {}).get(key, "not recorded")
        if was != value:
            raise CheckpointError(f"{source} was saved by a run with {key}={was!r}, this run has "
                                  f"{key}={value!r}: resume with the same settings, or start "
                                  "with an empty checkpoint directory")


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def load_model_state(model: torch.nn.Module, state: dict, source: Path) -> None:
    """``model.load_state_dict`` with one clear line when the checkpoint is for another model."""
    mine = model.state_dict()
    wrong = [k for k in mine.keys() & state.keys() if mine[k].shape != state[k].shape]
    if wrong:
        key = sorted(wrong)[0]
        raise CheckpointError(
            f"{source} was saved from a different model: {key} is {list(state[key].shape)} "
            f"there but {list(mine[key].shape)} here ({len(wrong)} tensor(s) differ in shape)")
    missing, unexpected = sorted(mine.keys() - state.keys()), sorted(state.keys() - mine.keys())
    if missing or unexpected:
        hint = ""
        if unexpected and all(k.startswith("module.") for k in unexpected):
            hint = "; it was saved from the DDP wrapper: save model.module.state_dict()"
        raise CheckpointError(f"{source} does not match this model: missing {missing[:2]}, "
                              f"unexpected {unexpected[:2]}{hint}")
    model.load_state_dict(state)

"""Chapter 07 solutions.  `make grade-07 FILE=<this file>`."""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
from pathlib import Path

import torch


# --8<-- [start:save_atomic]
def save_atomic(state: dict, path: Path) -> None:
    path = Path(path)
    # Same folder: os.replace is atomic only within one file system.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
# --8<-- [end:save_atomic]


# --8<-- [start:rng]
def capture_rng() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}
    # (on a GPU, add torch.cuda.get_rng_state_all(); with NumPy, np.random.get_state())


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
# --8<-- [end:rng]


# --8<-- [start:latest]
def latest_valid_checkpoint(directory: Path) -> Path | None:
    candidates = sorted(Path(directory).glob("step_*.pt"),
                        key=lambda p: int(p.stem.split("_")[1]), reverse=True)
    for path in candidates:  # newest first; fall back past the broken ones
        digest = path.with_suffix(".sha256")
        if digest.is_file() and \
                hashlib.sha256(path.read_bytes()).hexdigest() == digest.read_text().strip():
            return path
    return None
# --8<-- [end:latest]

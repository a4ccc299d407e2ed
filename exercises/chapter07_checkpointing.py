"""Chapter 07 exercises: saving and resuming.  Grade your work with `make grade-07`."""

from __future__ import annotations

from pathlib import Path

import torch  # noqa: F401 - you will need it


def save_atomic(state: dict, path: Path) -> None:
    """Exercise 07.1: ``torch.save(state, path)``, but a crash half-way through never leaves a
    broken file at ``path``: the previous checkpoint stays intact, and no temporary file is
    left behind whether the save succeeds or fails (the exception may propagate)."""
    raise NotImplementedError("exercise 07.1: write a temporary file, then os.replace it")


def capture_rng() -> dict:
    """Exercise 07.2: everything random that training depends on, as a dict torch.save can
    write: Python's ``random`` and torch's CPU generator.  ``restore_rng(capture_rng())``
    later makes the next random numbers exactly those that would have come next."""
    raise NotImplementedError("exercise 07.2: the state of every random number generator")


def restore_rng(state: dict) -> None:
    """Exercise 07.2 (second half): put back the state ``capture_rng`` returned."""
    raise NotImplementedError("exercise 07.2: set every generator's state back")


def latest_valid_checkpoint(directory: Path) -> Path | None:
    """Exercise 07.3: the newest intact checkpoint in ``directory``, or None.

    Checkpoints are ``step_NNNNNN.pt``, each with a ``step_NNNNNN.sha256`` file holding the
    hex SHA-256 of its bytes, written after it.  Newest = the highest step.  A checkpoint whose
    digest does not match, or that has no digest file, is not intact; other files are ignored.
    """
    raise NotImplementedError("exercise 07.3: newest step first, verify each SHA-256")

"""Mistakes: resumes without any RNG state; picks the checkpoint by the file's age."""

from pathlib import Path

from exercises.solutions.chapter07_checkpointing import save_atomic  # noqa: F401


def capture_rng():
    return {}


def restore_rng(state):
    pass


def latest_valid_checkpoint(directory):
    files = list(Path(directory).glob("step_*.pt"))
    return max(files, key=lambda p: p.stat().st_mtime_ns) if files else None

"""Which file and which exercises belong to a chapter."""

from __future__ import annotations

import importlib
from pathlib import Path

EXERCISES_DIR = Path(__file__).resolve().parents[1]
SLUGS = {1: "processes", 2: "collectives", 3: "ring_allreduce", 4: "hooks", 5: "data_parallel",
         6: "bubbles", 7: "checkpointing", 9: "compression"}


def learner_file(chapter: int) -> Path:
    """The learner's own file for a chapter: exercises/chapterNN_<slug>.py."""
    return EXERCISES_DIR / f"chapter{chapter:02d}_{SLUGS[chapter]}.py"


def solution_file(chapter: int) -> Path:
    return EXERCISES_DIR / "solutions" / f"chapter{chapter:02d}_{SLUGS[chapter]}.py"


def load_chapter(chapter: int) -> list:
    """The chapter's list of Exercise (its checks live in exercises/grader/chNN.py)."""
    return importlib.import_module(f"exercises.grader.ch{chapter:02d}").EXERCISES

"""Which file and which exercises belong to a chapter, and whether a file can be graded.

Light on purpose (no torch): the command line imports it before it can be interrupted cleanly."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import chapters as book_chapters  # scripts/chapters.py, the chapter registry

EXERCISES_DIR = Path(__file__).resolve().parents[1]
SLUGS = {c.number: c.slug for c in book_chapters.with_exercises()}


class UsageError(Exception):
    """The grader was called wrongly (a setting or a file): one line, exit status 2."""


def check_path(path: Path) -> None:
    """A file the grader can import, or a UsageError that says what is wrong with it."""
    if not path.is_file():
        raise UsageError(f"there is no file {path}" if not path.exists() else
                         f"{path} is not a file: give the path of your .py file")
    if path.suffix != ".py":
        raise UsageError(f"{path} is not a Python file: the grader imports your code, so give "
                         "the .py file you wrote the exercises in")


def learner_file(chapter: int) -> Path:
    """The learner's own file for a chapter: exercises/chapterNN_<slug>.py."""
    return EXERCISES_DIR / f"chapter{chapter:02d}_{SLUGS[chapter]}.py"


def solution_file(chapter: int) -> Path:
    return EXERCISES_DIR / "solutions" / f"chapter{chapter:02d}_{SLUGS[chapter]}.py"


def load_chapter(chapter: int) -> list:
    """The chapter's list of Exercise (its checks live in exercises/grader/chNN.py)."""
    return importlib.import_module(f"exercises.grader.ch{chapter:02d}").EXERCISES

"""Shared helpers for the tests: run a chapter script the way a reader would."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass
class ScriptRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run_script(*argv: str, timeout: float = 120) -> ScriptRun:
    """Run ``python <argv...>`` from the repository root, as `make run-chapterNN` would."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    return ScriptRun(proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start)


def assert_png(path: Path) -> None:
    assert path.is_file(), f"{path} was not written"
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), f"{path} is not a PNG"
    assert len(data) > 5_000, f"{path} is suspiciously small ({len(data)} bytes)"


def load_results(out: Path, chapter: int) -> dict:
    results = json.loads((out / f"chapter{chapter:02d}" / "results.json").read_text())
    assert results["chapter"] == chapter
    return results


def run_quick(tmp_path_factory, script: str, chapter: int, *extra: str) -> tuple:
    """A chapter's ``--quick`` run into a fresh directory: (run, that directory, results.json)."""
    out = tmp_path_factory.mktemp(f"ch{chapter:02d}")
    run = run_script(script, "--quick", *extra, "--out", str(out), timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, out, load_results(out, chapter)


PROVENANCE_KEYS = {"torch", "backend", "device", "world_size", "quick", "date", "git_commit"}


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    return tmp_path / "out"

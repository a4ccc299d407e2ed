"""results.json and the figures beside it: every number the book prints, with where it came from.

A chapter computes first and writes last.  ``chapter_output`` hands out a staging directory; only
when everything in it was written does it put it in place of ``DIR/chapterNN/``, as one set.  A
run that fails half-way leaves the previous results untouched.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .ranks import RankContext

REPO_ROOT = Path(__file__).resolve().parents[3]
_IMPORTED = time.time()


def process_start() -> float:
    """When this process started, on time.time()'s clock.  Linux: from /proc, so the wall time
    counts the interpreter's and torch's start-up too; elsewhere: when ddplab was imported."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - started_after_boot)
    except (OSError, ValueError, IndexError):
        return _IMPORTED


def provenance(ctx: RankContext) -> dict:
    """Where a number was measured: enough to tell a laptop run from an 8-GPU run."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": ctx.backend,
        "device": device_name(ctx.device),
        "world_size": ctx.world_size,
        "launcher": ctx.launcher,
        "quick": ctx.quick,
        "seed": ctx.seed,
        "cpu_count": os.cpu_count(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
    }


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def git_commit() -> str:
    """The commit the code ran at, with '+dirty' when the working tree had changes.

    The chapters' own outputs (figures/) do not count: ``make figures`` rewrites them one
    chapter after another, and the code that made them is what the commit names.
    """
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!figures")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def write_results(directory: Path, chapter: int, metrics: dict, provenance: dict) -> Path:
    """Write ``results.json``: ``{"chapter": NN, "seconds": …, "provenance": {...}, **metrics}``.

    ``seconds``: this run's wall time so far, from the start of the process that writes (under
    torchrun: rank 0's).  ``make bench`` reads it to keep the ``--quick`` runs under a minute.
    """
    seconds = round(time.time() - process_start(), 2)
    payload = {"chapter": chapter, "seconds": seconds, "provenance": provenance, **metrics}
    path = directory / "results.json"
    text = json.dumps(_finite(payload), indent=2, sort_keys=False) + "\n"
    _atomic_write_text(path, text)
    return path


def read_results(out: Path, chapter: int) -> dict:
    return json.loads((Path(out) / f"chapter{chapter:02d}" / "results.json").read_text())


@contextmanager
def chapter_output(out: Path, chapter: int) -> Iterator[Path]:
    """Stage a chapter's files, then put them in place of ``out/chapterNN`` as one set.

    The new directory replaces the old one whole: a figure this run did not draw (a part it
    skipped) does not survive next to a results.json that says it was skipped.
    """
    final = Path(out) / f"chapter{chapter:02d}"
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".chapter{chapter:02d}-", dir=final.parent))
    try:
        yield staging
        _swap_into_place(staging, final)
    except OSError as err:  # a full disk: name the folder, not a staging file that is gone
        if err.filename is None or Path(err.filename).parent == staging:
            raise OSError(err.errno, err.strerror, str(final)) from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _swap_into_place(staging: Path, final: Path) -> None:
    """Two renames, under a lock on the parent directory so that concurrent runs take turns.

    Between the renames ``final`` is briefly absent; a crash there leaves the previous set in
    ``.chapterNN-old-PID`` next to it.
    """
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp's directory is private; figures are not
    lock = os.open(final.parent, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = final.with_name(f".{final.name}-old-{os.getpid()}")
        if final.exists():
            os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        os.close(lock)  # closing releases the lock


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _finite(value):
    """JSON has no NaN or Infinity: write them as null, so every reader can parse the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value

"""``make bench``: every chapter's ``--quick`` run, one at a time, and its wall time.

The book promises that each chapter's ``--quick`` run (the workshop's) finishes within a minute.
That is a measurement, not a test: a loaded CI machine can miss it without anything being wrong.
So the tests never time a run; this benchmark does, on a machine you choose.  Each chapter runs
into a scratch directory (``figures/`` is left alone), records its own wall time in its
``results.json`` (the ``seconds`` key, written by ``ddplab.write_results``), and the table below
flags every chapter over the limit.  A slow chapter is flagged, not failed: the exit status is 0
unless a chapter itself failed.

    python tools/bench.py [--limit 60] [extra flags for every chapter, e.g. --world-size 2]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 60.0


@dataclass
class Row:
    chapter: int
    script: str
    seconds: float | None  # from results.json; None when the run wrote none
    error: str = ""  # why there is no time: the run failed, or its results.json lacks one


def chapter_scripts(root: Path = ROOT) -> list[Path]:
    return sorted((root / "scripts").glob("chapter[0-9][0-9]_*.py"))


def chapter_number(script: Path) -> int:
    return int(re.match(r"chapter(\d{2})_", script.name).group(1))


def read_row(out: Path, script: Path, returncode: int = 0, stderr: str = "") -> Row:
    """The row for one finished run: its wall time from ``out/chapterNN/results.json``."""
    chapter = chapter_number(script)
    if returncode != 0:
        last = stderr.strip().splitlines()[-1:] or [""]
        return Row(chapter, script.name, None, f"exit {returncode}: {last[0]}")
    path = out / f"chapter{chapter:02d}" / "results.json"
    try:
        seconds = json.loads(path.read_text()).get("seconds")
    except (OSError, ValueError) as err:
        return Row(chapter, script.name, None, f"no results.json ({err.__class__.__name__})")
    if not isinstance(seconds, (int, float)):
        return Row(chapter, script.name, None, "results.json has no 'seconds'")
    return Row(chapter, script.name, float(seconds))


def table(rows: list[Row], limit: float = LIMIT_S) -> str:
    """The report: one line per chapter, slow ones flagged, and a verdict at the end."""
    lines = [f"{'chapter':<32} {'--quick wall time':>18}"]
    for row in rows:
        if row.seconds is None:
            lines.append(f"{row.script:<32} {'—':>18}   FAILED ({row.error})")
        else:
            flag = f"   SLOW: over {limit:.0f} s" if row.seconds > limit else ""
            lines.append(f"{row.script:<32} {row.seconds:>16.1f} s{flag}")
    slow = [r for r in rows if r.seconds is not None and r.seconds > limit]
    failed = [r for r in rows if r.seconds is None]
    verdict = f"all {len(rows)} chapters within {limit:.0f} s"
    if slow:
        verdict = (f"{len(slow)} chapter(s) over {limit:.0f} s (flagged; the exit status stays 0: "
                   "a benchmark on this machine, not a test)")
    if failed:
        verdict = f"{len(failed)} chapter(s) failed; " + verdict
    return "\n".join([*lines, verdict])


def exit_status(rows: list[Row]) -> int:
    """Non-zero only when a chapter failed; a slow chapter is reported, not failed."""
    return 1 if any(r.seconds is None for r in rows) else 0


def run_all(scripts: list[Path], extra: list[str], scratch: Path) -> list[Row]:
    rows = []
    for script in scripts:
        print(f"== {script.name} --quick {' '.join(extra)}".rstrip(), flush=True)
        proc = subprocess.run([sys.executable, str(script), "--quick", *extra,
                               "--out", str(scratch)], cwd=ROOT, capture_output=True, text=True)
        rows.append(read_row(scratch, script, proc.returncode, proc.stderr))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=float, default=LIMIT_S, help="flag runs over this (s)")
    args, extra = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="ddplab-bench-") as scratch:
        rows = run_all(chapter_scripts(), extra, Path(scratch))
    print(table(rows, args.limit))
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())

"""``--replot``: a chapter's figures redrawn from the files of its last run, no rank started.

A chapter's figures are a pure function of what its run wrote into ``DIR/chapterNN/``:
``results.json``, and, for a figure that needs more than the numbers the page prints, a JSON
file of its own beside it (``ring_steps.json`` beside ``ring_steps.png``), so results.json stays
readable.  The drawing lives in ``scripts/figures/chapterNN.py``, with one entry,
``draw(results, folder) -> [file names]``.  A run writes its files, then draws from them as
read back; ``--replot`` draws from the files already there.  Both draw the same figures from the
same bytes, so restyling a figure takes a second instead of a run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .cli import UsageError

Draw = Callable[[dict, Path], list[str]]  # (results.json's content, its folder) -> PNG names


def draw_figures(folder: Path, draw: Draw) -> list[str]:
    """Draw every figure into ``folder`` from the results.json in it, as written to disk."""
    path = Path(folder) / "results.json"
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(f"{path} is not valid JSON ({err}): run the chapter again") from None
    return draw(results, Path(folder))


def replot(out: Path, chapter: int, draw: Draw) -> list[str]:
    """What ``--replot`` does: redraw ``out/chapterNN/*.png`` from that folder's files."""
    folder = Path(out) / f"chapter{chapter:02d}"
    if not (folder / "results.json").is_file():
        raise UsageError(f"--replot needs {folder / 'results.json'}, which does not exist: "
                         f"run the chapter without --replot first (make run-chapter{chapter:02d})")
    names = draw_figures(folder, draw)
    print(f"redrew {len(names)} figures in {folder}/ from results.json: {', '.join(names)}")
    return names


def write_figure_data(folder: Path, name: str, data: Any) -> Path:
    """Save what a figure draws beyond results.json, as ``folder/name`` (compact JSON)."""
    path = Path(folder) / name
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return path


def read_figure_data(folder: Path, name: str) -> Any:
    """The data a run saved for one figure; a folder from an older run may lack it."""
    path = Path(folder) / name
    if not path.is_file():
        raise UsageError(f"{path} does not exist (a run of an older version of this chapter?): "
                         "run the chapter again to write it")
    return json.loads(path.read_text())

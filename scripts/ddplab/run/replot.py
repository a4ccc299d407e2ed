"""``--replot``: a chapter's figures redrawn from the files of its last run, no rank started.

A chapter's figures are a pure function of what its run wrote into ``DIR/chapterNN/``:
``results.json``, and, for a figure that needs more than the numbers the page prints, a JSON
file of its own beside it (``ring_steps.json`` beside ``ring_steps.png``), so results.json stays
readable.  The drawing lives in ``scripts/drawing/chapterNN.py``, with one entry,
``draw(results, folder) -> [file names]``.  A run writes its files, then draws from them as
read back; ``--replot`` draws from the files already there.  Both draw the same figures from the
same bytes, so restyling a figure takes a second instead of a run.

A results.json edited by hand (a key deleted, a number made a string, NaN) is checked before
anything is drawn against the drawing module's ``SCHEMA``: the keys its drawing reads, dotted
(``"step_time_ms.native"``; ``*`` stands for every key of a dict), each with its kind
(``"dict"``, ``"list"``, ``"str"``, ``"number"``: finite).  The first key that is missing or of
the wrong kind is named, with the file.
"""

from __future__ import annotations

import errno
import inspect
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .cli import UsageError

Draw = Callable[[dict, Path], list[str]]  # (results.json's content, its folder) -> PNG names
AGAIN = "edited by hand? run the chapter again to rewrite it"
KINDS = {"dict": dict, "list": list, "str": str, "number": (int, float)}
# What a hand-edited file can make a drawing raise; --replot names the file instead.
DRAWING_ERRORS = (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError,
                  AttributeError)


def draw_figures(folder: Path, draw: Draw) -> list[str]:
    """Draw every figure into ``folder`` from the results.json in it, as written to disk."""
    path = Path(folder) / "results.json"
    results = read_json(path)
    if not isinstance(results, dict):
        raise UsageError(f"{path}: holds {_kind(results)}, not the chapter's results ({AGAIN})")
    check_schema(results, getattr(inspect.getmodule(draw), "SCHEMA", {}), path)
    try:
        return draw(results, Path(folder))
    except OSError as err:  # a full disk: matplotlib's error does not name the file
        if err.filename is None and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise OSError(err.errno, err.strerror, str(folder)) from None
        raise


def replot(out: Path, chapter: int, draw: Draw) -> list[str]:
    """What ``--replot`` does: redraw ``out/chapterNN/*.png`` from that folder's files."""
    folder = Path(out) / f"chapter{chapter:02d}"
    if not (folder / "results.json").is_file():
        raise UsageError(f"--replot needs {folder / 'results.json'}, which does not exist: "
                         f"run the chapter without --replot first (make run-chapter{chapter:02d})")
    try:
        names = draw_figures(folder, draw)
    except DRAWING_ERRORS as err:  # what the schema does not cover: still the file, one line
        raise UsageError(f"{folder}: cannot draw from these files ({type(err).__name__}: "
                         f"{err}; {AGAIN})") from None
    print(f"redrew {len(names)} figures in {folder}/ from results.json: {', '.join(names)}")
    return names


def read_json(path: Path) -> Any:
    """A JSON file written by a run; whatever is wrong with it is one line naming it."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise UsageError(f"{path}: byte {err.start} is not UTF-8 text ({AGAIN})") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"{path} is not valid JSON ({err}; cut short? {AGAIN})") from None


def check_schema(results: dict, schema: dict[str, str], path: Path) -> None:
    """Raise a one-line UsageError for the first key of ``schema`` missing or of another kind."""
    for key, kind in schema.items():
        for name, value in _lookup(results, key.split("."), [], path):
            if not isinstance(value, KINDS[kind]) or isinstance(value, bool):
                raise UsageError(f'{path}: key "{name}" should be {_article(kind)}, got '
                                 f"{_kind(value)} ({AGAIN})")
            if kind == "number" and not math.isfinite(value):
                raise UsageError(f'{path}: key "{name}" is {value}, not a number ({AGAIN})')


def _lookup(value: Any, parts: list[str], done: list[str], path: Path):
    """Yield (dotted name, value) for every match of ``parts`` below ``value``."""
    if not parts:
        yield ".".join(done), value
        return
    head, rest = parts[0], parts[1:]
    where = ".".join(done)
    if not isinstance(value, dict):
        raise UsageError(f'{path}: key "{where}" should be a dict, got {_kind(value)} ({AGAIN})')
    if head == "*":
        for key, child in value.items():
            yield from _lookup(child, rest, [*done, key], path)
        return
    if head not in value:
        raise UsageError(f'{path}: key "{".".join([*done, head])}" is missing ({AGAIN})')
    yield from _lookup(value[head], rest, [*done, head], path)


def _article(kind: str) -> str:
    return {"dict": "a dict", "list": "a list", "str": "a string", "number": "a number"}[kind]


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return {dict: "a dict", list: "a list", str: "a string"}.get(type(value),
                                                                  f"the number {value}")


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
    return read_json(path)

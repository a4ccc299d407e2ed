"""A chapter's ``main``, written once: redraw, or run the ranks, finish, write, print.

Every chapter script ends the same way, so the steps live here and the script hands over its
own ones by name::

    def main(argv=None):
        return run_chapter(CHAPTER, parse_args(argv), worker, finish=finish,
                           draw=drawing.draw, summarize=summarize)

``--replot`` redraws the figures from the last run's files and starts no rank.  Otherwise
``worker`` runs on every rank (``launch``), ``finish(args, run)`` turns rank 0's result into the
chapter's metrics (and may run more), and the folder ``out/chapterNN/`` is written as one set:
results.json, the ``extras(folder, metrics, run)`` files, the figures drawn from them.  Then
``summarize(metrics, run)`` is printed, and the line that says what was written.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

from .launch import Run, launch
from .replot import Draw, draw_figures, replot
from .results import chapter_output, write_results

Wrote = Callable[[Path, list[str], list[str]], str]  # (folder, figures, extras) -> last line


def every_file(folder: Path, figures: list[str], extras: list[str]) -> str:
    """``wrote out/chapterNN/{a.png, b.png, extra.json, results.json}``"""
    return f"wrote {folder}/{{{', '.join([*figures, *extras, 'results.json'])}}}"


def figures_only(folder: Path, figures: list[str], extras: list[str]) -> str:
    """``wrote out/chapterNN/{a.png, b.png, results.json}``"""
    return f"wrote {folder}/{{{', '.join([*figures, 'results.json'])}}}"


def the_folder(folder: Path, figures: list[str], extras: list[str]) -> str:
    """``wrote out/chapterNN/``"""
    return f"wrote {folder}/"


def run_chapter(chapter: int, args: Namespace, worker: Callable | None = None, *,
                finish: Callable[[Namespace, Run], dict], draw: Draw,
                summarize: Callable[[dict, Run], str],
                start: Callable[[Namespace], Run | None] | None = None,
                extras: Callable[[Path, dict, Run], list[str]] | None = None,
                wrote: Wrote = every_file) -> dict | None:
    """The chapter's run from its parsed flags; rank 0's metrics, or None where nothing was
    measured (``--replot``, a non-zero rank under torchrun).  ``start(args)`` replaces
    ``launch(worker, args)`` for a chapter whose ranks start otherwise."""
    if args.replot:  # redraw the figures from the last run's files; no rank is started
        replot(args.out, chapter, draw)
        return None
    run = start(args) if start is not None else launch(worker, args)
    if run is None:  # a non-zero rank under torchrun: rank 0 writes the files
        return None
    metrics = finish(args, run)
    with chapter_output(args.out, chapter) as out:
        write_results(out, chapter, metrics, run.provenance)
        written = extras(out, metrics, run) if extras is not None else []
        drawn = draw_figures(out, draw)
    print(summarize(metrics, run))
    print(wrote(Path(args.out) / f"chapter{chapter:02d}", drawn, written))
    return metrics

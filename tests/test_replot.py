"""--replot: every chapter with a drawing module (scripts/drawing/chapterNN.py) redraws each of its
committed figures from the committed run's files alone, without starting a rank."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed
import torch.multiprocessing
from conftest import REPO, assert_png, run_script

import ddplab
from ddplab.run.cli import UsageError

FIGURES = REPO / "figures"
# Each chapter that draws from its files: its number and its script's module name.
CHAPTERS = {int(p.stem[len("chapter"):]): next(REPO.glob(f"scripts/{p.stem}_*.py")).stem
            for p in sorted((REPO / "scripts" / "drawing").glob("chapter[0-9][0-9].py"))}


def no_rank_may_start(monkeypatch) -> None:
    """Every way a chapter could start a rank raises instead."""
    def refuse(*args, **kwargs):
        raise AssertionError("--replot started a rank")
    monkeypatch.setattr(ddplab, "launch", refuse)
    for module, name in ((torch.multiprocessing, "start_processes"),
                         (torch.multiprocessing, "spawn"),
                         (torch.distributed, "init_process_group")):
        monkeypatch.setattr(module, name, refuse)


def committed_run(tmp_path: Path, chapter: int) -> tuple[Path, list[str]]:
    """A copy of the committed chapter folder without its PNGs, and the PNGs' names."""
    source = FIGURES / f"chapter{chapter:02d}"
    folder = tmp_path / source.name
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.png"))
    return folder, sorted(p.name for p in source.glob("*.png"))


def test_every_chapter_with_figures_has_a_drawing_module():
    drawn = {int(p.name[len("chapter"):]) for p in FIGURES.glob("chapter[0-9][0-9]")
             if any(p.glob("*.png"))}
    scripts = {int(p.name[len("chapter"):][:2]) for p in REPO.glob("scripts/chapter[0-9]*_*.py")}
    assert drawn == CHAPTERS.keys() and drawn <= scripts and 8 not in drawn


def test_a_chapter_without_figures_says_so_and_exits_0(tmp_path):
    run = run_script("scripts/chapter08_bug_lab.py", "--replot", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines() == [
        "chapter 08 draws no figures: nothing to redraw (it writes results.json and fix_*.diff)"]
    assert not any(tmp_path.iterdir())  # nothing written, no rank started


@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_replot_redraws_every_committed_figure_without_starting_a_rank(chapter, tmp_path,
                                                                       monkeypatch):
    folder, pngs = committed_run(tmp_path, chapter)
    inputs = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert pngs and "results.json" in inputs
    no_rank_may_start(monkeypatch)
    script = importlib.import_module(CHAPTERS[chapter])
    script.main(["--replot", "--out", str(tmp_path)])
    for name in pngs:
        assert_png(folder / name)
    after = {p.name for p in folder.iterdir()}
    assert after == inputs.keys() | set(pngs), "--replot wrote something other than the figures"
    assert {name: (folder / name).read_bytes() for name in inputs} == inputs  # inputs untouched


@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_replot_without_a_run_says_what_to_run(chapter, tmp_path, monkeypatch):
    no_rank_may_start(monkeypatch)
    script = importlib.import_module(CHAPTERS[chapter])
    with pytest.raises(UsageError, match=rf"results\.json.*make run-chapter{chapter:02d}"):
        script.main(["--replot", "--out", str(tmp_path)])


def test_replot_without_a_run_is_one_line_and_exit_2(tmp_path):
    run = run_script("scripts/chapter01_processes.py", "--replot", "--out", str(tmp_path))
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0] == (f"error: --replot needs {tmp_path / 'chapter01' / 'results.json'}, "
                        "which does not exist: run the chapter without --replot first "
                        "(make run-chapter01)")


def test_a_missing_figure_data_file_is_named(tmp_path, monkeypatch):
    folder, _ = committed_run(tmp_path, 1)
    (folder / "replicas.json").unlink()  # what replicas.png draws, beside results.json
    script = importlib.import_module(CHAPTERS[1])
    with pytest.raises(UsageError, match=r"replicas\.json does not exist.*run the chapter again"):
        script.main(["--replot", "--out", str(tmp_path)])


def test_a_chapter_without_replot_refuses_instead_of_running():
    args = SimpleNamespace(replot=True, world_size=2, backend="gloo")
    with pytest.raises(UsageError, match="cannot --replot yet"):
        ddplab.launch(lambda ctx, args: None, args)

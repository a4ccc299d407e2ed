"""Every list of chapters agrees with the one registry, scripts/chapters.py.

A chapter missing from the nav, README's table, the pages, the drawings, the tests or the
committed figures fails here, with the name of the list it is missing from."""

from __future__ import annotations

import json
import re

import gpu_check
import pytest
from conftest import REPO
from mkdocs.config import load_config

import chapters
from exercises.grader.chapters import SLUGS

CHAPTERS = chapters.CHAPTERS


def nav_chapter_pages() -> list[tuple[str, str]]:
    """(title, page) of every nav entry that is a chapter page, in nav order."""
    nav = load_config(str(REPO / "mkdocs.yml"))["nav"]

    def walk(entries):
        for entry in entries:
            for title, target in entry.items():
                if isinstance(target, list):
                    yield from walk(target)
                elif target.startswith("chapters/"):
                    yield title, target
    return list(walk(nav))


def test_the_registry_numbers_chapters_00_to_the_last_without_a_gap():
    assert [c.number for c in CHAPTERS] == list(range(len(CHAPTERS)))


def test_the_nav_lists_every_chapter_in_order_with_its_title():
    expected = [(c.title if c.number == 0 else f"{c.nn} {c.title}", c.page) for c in CHAPTERS]
    assert nav_chapter_pages() == expected


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.nn)
def test_every_chapter_has_its_script_page_and_tests(chapter):
    assert (REPO / chapter.script).is_file(), f"{chapter.script} is missing"
    assert (REPO / "docs" / chapter.page).is_file(), f"docs/{chapter.page} is missing"
    test = "test_hello_ddp.py" if chapter.number == 0 else f"test_chapter{chapter.nn}.py"
    assert (REPO / "tests" / test).is_file(), f"tests/{test} is missing"


@pytest.mark.parametrize("chapter", chapters.with_results(), ids=lambda c: c.nn)
def test_every_chapter_has_committed_results_that_hold_its_headlines(chapter):
    results = json.loads((REPO / "figures" / f"chapter{chapter.nn}" / "results.json").read_text())
    assert results["chapter"] == chapter.number
    for headline in chapter.headlines:
        value = results
        for key in headline.key.split("."):
            assert isinstance(value, dict) and key in value, \
                f"chapter {chapter.nn}'s headline {headline.key!r} is not in its results.json"
            value = value[key]


def test_no_script_or_page_is_missing_from_the_registry():
    scripts = sorted(p.relative_to(REPO).as_posix()
                     for p in (REPO / "scripts").glob("chapter[0-9][0-9]_*.py"))
    pages = sorted(p.relative_to(REPO / "docs").as_posix()
                   for p in (REPO / "docs" / "chapters").glob("[0-9][0-9]-*.md"))
    assert scripts == [c.script for c in CHAPTERS if c.number > 0]
    assert pages == [c.page for c in CHAPTERS]


def test_readmes_table_is_the_registrys():
    readme = (REPO / "README.md").read_text()
    assert chapters.readme_table() in readme, (
        "README.md's chapter table differs from scripts/chapters.py: replace it with the output "
        "of `python scripts/chapters.py readme`")


def test_the_graders_and_gpu_check_read_the_registry():
    assert {c.number: c.slug for c in CHAPTERS if c.exercises} == SLUGS
    for c in chapters.with_exercises():
        assert (REPO / "exercises" / f"chapter{c.nn}_{c.slug}.py").is_file()
    assert set(gpu_check.HEADLINES) == {c.nn for c in CHAPTERS}


def test_the_site_renders_both_tables_from_the_registry():
    for page, table in (("index.md", "index"), ("running.md", "gpu")):
        text = (REPO / "docs" / page).read_text()
        assert "{{ chapters " + table + " }}" in text
        assert not re.search(r"^\| 0[1-9] ", text, re.MULTILINE), f"{page} types a chapter row"


def test_an_unknown_chapter_is_named_with_the_list():
    with pytest.raises(KeyError, match=r"there is no chapter 42 \(chapters: 00, 01"):
        chapters.by_number(42)

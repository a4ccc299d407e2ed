"""The shape every chapter page promises a learner: a learn/need box, a summary,
questions with collapsed answers, listings that show an idea (<= 30 lines), drawn diagrams that
exist.  Every chapter page, the ones still to come included.  Solutions to the exercises are
listings of a whole answer, and the cluster recipes whole files to copy: they may be longer."""

from __future__ import annotations

import re

import pytest
from conftest import REPO

PAGES = sorted(p.name for p in (REPO / "docs" / "chapters").glob("[0-9][0-9]-*.md"))
MAX_LISTING_LINES = 30
SNIPPET = re.compile(r'--8<-- "([^":]+):([^"]+)"')


def section_lines(path: str, name: str) -> list[str]:
    text = (REPO / path).read_text().splitlines()
    start = text.index(next(line for line in text if f"--8<-- [start:{name}]" in line))
    end = text.index(next(line for line in text if f"--8<-- [end:{name}]" in line))
    return text[start + 1:end]


@pytest.mark.parametrize("page", PAGES)
def test_page_has_the_learners_scaffolding(page):
    text = (REPO / "docs" / "chapters" / page).read_text()
    assert re.search(r'^!!! abstract ".+"$', text, re.M), "no 'you will learn / you need' box"
    assert "**You need**" in text
    assert "\n## Summary\n" in text
    assert text.index("## Summary") < text.index("## Check your understanding")
    assert len(re.findall(r'^\?\?\? question "', text, re.M)) >= 3


@pytest.mark.parametrize("page", PAGES)
def test_listings_show_an_idea_not_a_file(page):
    text = (REPO / "docs" / "chapters" / page).read_text()
    for path, name in SNIPPET.findall(text):
        if path.startswith(("exercises/solutions/", "recipes/")):
            continue  # a whole answer, or a whole file to copy onto a cluster
        lines = section_lines(path, name)
        assert len(lines) <= MAX_LISTING_LINES, f"{page}: {path}:{name} is {len(lines)} lines"


@pytest.mark.parametrize("page", PAGES)
def test_every_figure_on_the_page_exists(page):
    text = (REPO / "docs" / "chapters" / page).read_text()
    for figure in re.findall(r"\]\(\.\./figures/([^)]+\.png)\)", text):
        assert (REPO / "figures" / figure).is_file(), figure


@pytest.mark.parametrize("page", PAGES)
def test_every_listing_sits_in_a_code_fence(page):
    """An include outside a fence renders as a paragraph of run-together code."""
    lines = (REPO / "docs" / "chapters" / page).read_text().splitlines()
    for i, line in enumerate(lines):
        if SNIPPET.search(line) and line.strip().startswith("--8<--"):
            assert lines[i - 1].strip().startswith("```"), f"{page}:{i + 1}: {line.strip()}"

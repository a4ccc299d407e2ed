"""The site: builds with --strict, offline, with figures and numbers from the runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import mkdocs_hooks
import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site_dir = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site_dir)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # see Makefile
    assert proc.returncode == 0, proc.stderr
    return site_dir


def test_every_chapter_page_is_built(site):
    for page in sorted((REPO / "docs" / "chapters").glob("*.md")):
        assert (site / "chapters" / page.stem / "index.html").is_file()


def test_committed_figures_are_published(site):
    for png in (REPO / "figures").rglob("*.png"):
        assert (site / "figures" / png.relative_to(REPO / "figures")).is_file()


def test_no_page_loads_anything_from_the_internet(site):
    remote = re.compile(r"""<(?:script|link|img)[^>]+(?:src|href)=["']?(?:https?:)?//""")
    for html in site.rglob("*.html"):
        found = remote.findall(html.read_text())
        assert not found, f"{html.relative_to(site)} loads {found}"
    assert (site / "javascripts" / "mathjax" / "tex-chtml.js").is_file()


def test_numbers_are_filled_in_from_results(site):
    html = (site / "chapters" / "01-processes" / "index.html").read_text()
    assert "{{" not in html
    assert "Measured on" in html


def test_results_notebook_is_executed_at_build_time(site):
    html = (site / "results" / "index.html").read_text()
    assert "BucketedDDP step time / native" in html  # the output of the last cell
    assert "<em>not run yet</em>" not in html, "a chapter has no committed results.json"
    assert "<td>—</td>" not in html, "a headline key is missing from a results.json"
    assert (site / "results" / "results.ipynb").is_file()  # offered for download


def test_placeholders_render_and_fail_loudly():
    results = mkdocs_hooks.load_results(1)
    value = results["replicas"]["seed_plus_rank"]["max_abs_diff"]
    assert mkdocs_hooks.render("result", "01", "replicas.seed_plus_rank.max_abs_diff", ".3g") \
        == format(value, ".3g")
    assert mkdocs_hooks.render("provenance", "01", None, None).startswith("*Measured on")
    with pytest.raises(KeyError, match="no key"):
        mkdocs_hooks.render("result", "01", "replicas.no_such_key", None)
    with pytest.raises(FileNotFoundError, match="make run-chapter99"):
        mkdocs_hooks.render("result", "99", "x", None)

"""The site: builds with --strict, offline, with figures and numbers from the runs."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import mkdocs_hooks
import pytest
from conftest import REPO
from mkdocs.exceptions import PluginError


@pytest.fixture(scope="module")
def site(built_site):
    return built_site  # shared with tests/test_browser.py (conftest.py)


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
    results = mkdocs_hooks.load_results("01")
    value = results["replicas"]["seed_plus_rank"]["max_abs_diff"]
    assert mkdocs_hooks.render("result", "01", "replicas.seed_plus_rank.max_abs_diff", ".3g") \
        == format(value, ".3g")
    assert mkdocs_hooks.render("provenance", "01", None, None).startswith("*Measured on")
    with pytest.raises(KeyError, match="no key"):
        mkdocs_hooks.render("result", "01", "replicas.no_such_key", None)
    with pytest.raises(FileNotFoundError, match="make run-chapter99"):
        mkdocs_hooks.render("result", "99", "x", None)


def test_every_local_script_stylesheet_and_image_a_page_asks_for_exists(site):
    """(The results notebook's page used to ask for results/javascripts/mathjax/tex-chtml.js.)"""
    asks = re.compile(r"""<(?:script|img)\s[^>]*src="([^"]+)"|<link\s[^>]*href="([^"]+)\"""")
    missing = []
    for html in site.rglob("*.html"):
        if html.name == "404.html":  # served for any path: its links are absolute, from "/"
            continue
        for match in asks.finditer(html.read_text()):
            url = (match.group(1) or match.group(2)).split("?")[0].split("#")[0]
            if url and not re.match(r"[a-z]+:", url) and not (html.parent / url).exists():
                missing.append(f"{html.relative_to(site)} -> {url}")
    assert missing == []


def search_tokens(text: str, separator: str) -> set[str]:
    """Split text into search terms as the site's search does (lunr, lower-cased)."""
    return {token.lower() for token in re.split(separator, text) if token}


@pytest.mark.parametrize("word", ["all_reduce", "straggler"])
def test_search_index_finds_every_page_that_contains_a_word(site, word):
    """Like a reader typing the word: a page hits when one of its terms starts with it."""
    index = json.loads((site / "search" / "search_index.json").read_text())
    separator = index["config"]["separator"]
    assert search_tokens(word, separator) == {word}, "the query itself must stay one term"
    containing, hits = set(), set()
    for doc in index["docs"]:
        page = doc["location"].split("#")[0]
        text = html_to_text(doc["title"] + " " + doc["text"])
        if re.search(rf"(?<![A-Za-z0-9_]){word}", text, re.IGNORECASE):
            containing.add(page)
        if any(t.startswith(word) for t in search_tokens(text, separator)):
            hits.add(page)
    assert len(containing) >= 2, f"only {containing} contain {word!r}: pick another word"
    assert containing <= hits


def html_to_text(html: str) -> str:
    return re.sub(r"<[^>]+>", " ", html).replace("&lt;", "<").replace("&gt;", ">")


def test_troubleshooting_is_a_definition_list(site):
    html = (site / "running" / "index.html").read_text()
    assert "<dl>" in html and "<dt>" in html
    assert "\n: " not in html and "<p>:   " not in html


def test_site_url_and_offline_come_from_the_environment(monkeypatch):
    from mkdocs.config import load_config

    monkeypatch.delenv("OFFLINE", raising=False)
    monkeypatch.setenv("SITE_URL", "https://example.org/ddp-from-scratch/")
    config = load_config(str(REPO / "mkdocs.yml"))
    assert config.site_url == "https://example.org/ddp-from-scratch/"
    assert config.plugins["material/offline"].config.enabled is False  # hosted: clean URLs
    monkeypatch.setenv("OFFLINE", "true")
    assert load_config(str(REPO / "mkdocs.yml")).plugins["material/offline"].config.enabled


def test_the_404_page_lists_the_book(site):
    html = (site / "404.html").read_text()
    assert "This page is not in the book" in html
    assert 'href="/chapters/01-processes/"' in html


def test_the_notebook_page_loads_the_sites_mathjax_only(site):
    html = (site / "results" / "index.html").read_text()
    assert "notebook-mathjax-removed-by-hook" not in html
    assert html.count("mathjax/tex-chtml.js") == 1  # the site's, from extra_javascript
    page = SimpleNamespace(file=SimpleNamespace(src_uri="other.ipynb"))
    with pytest.raises(PluginError, match="no longer loads MathJax"):
        mkdocs_hooks.on_post_page("<html>a changed template</html>", page, None)

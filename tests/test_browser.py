"""The site in a real browser: every page as a reader sees it, in headless Chromium.

Playwright drives the system's Chromium (``apt-get install chromium``; no browser download).
Without one, the module is skipped with the reason, except where the browser test is required
(``CI=true`` or ``REQUIRE_BROWSER_TEST=1``): there a missing browser fails.  The site is built
once, served by a local ``http.server`` on a free port, and every page of the build is visited
(whatever pages it has: nothing here lists them).
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import threading
import urllib.request
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse

import pytest
from build_offline import build_offline

DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
NOT_PAGES = ("assets/", "javascripts/", "figures/", "search/", "stylesheets/", "404.html")
# Figures drawn wider than a 1280-px screen's column (natural width > column / 0.8) would fill the
# column but stay under 80 % of their natural width; ddplab.run.plotting.save keeps every figure
# within the column, so this list is empty and must stay so.
DRAWN_WIDER_THAN_THE_COLUMN: set[str] = set()  # none since plotting.save fits the column


def find_chromium() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser",
                      "google-chrome"):
        if candidate and (path := shutil.which(candidate)):
            return path
    return None


def browser_required() -> bool:
    return (os.environ.get("CI", "").lower() == "true"
            or bool(os.environ.get("REQUIRE_BROWSER_TEST")))


def skip_or_fail(reason: str):
    if browser_required():
        pytest.fail(f"the browser test is required here (CI or REQUIRE_BROWSER_TEST) but "
                    f"{reason}", pytrace=False)
    pytest.skip(f"browser test skipped: {reason}")


@pytest.fixture(scope="session")
def chromium():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        skip_or_fail("playwright is not installed (pip install -r requirements.txt)")
    executable = find_chromium()
    if executable is None:
        skip_or_fail("no Chromium found (apt-get install chromium, or CHROMIUM=/path/to/it)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def site(chromium, built_site) -> Path:
    return built_site  # shared with tests/test_site.py (conftest.py)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="session")
def server(site):
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


def page_paths(site: Path) -> list[str]:
    """Every page of the build, as a URL path relative to the site's root."""
    paths = []
    for html in sorted(site.rglob("*.html")):
        rel = html.relative_to(site).as_posix()
        if not rel.startswith(NOT_PAGES):
            paths.append(rel.removesuffix("index.html"))
    return paths


@dataclass
class PageReport:
    url: str
    console_errors: list[str] = field(default_factory=list)
    bad_requests: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)


READ_PAGE = """async () => {
  if (window.MathJax && MathJax.startup) await MathJax.startup.promise;
  const content = document.querySelector('.md-content').cloneNode(true);
  content.querySelectorAll('script, style').forEach(e => e.remove());
  const text = content.textContent;  // also what collapsed blocks hold
  const prose = content;
  prose.querySelectorAll('pre, code, mjx-container').forEach(e => e.remove());
  const column = document.querySelector('.md-content__inner');
  return {
    text: text,
    prose: prose.textContent,
    images: [...document.querySelectorAll('img')].map(i => ({
      src: i.getAttribute('src'), loaded: i.complete && i.naturalWidth > 0,
      width: i.width, natural: i.naturalWidth, figure: !!i.closest('.md-content')})),
    column: column.clientWidth,
    mathUntypeset: [...document.querySelectorAll('.arithmatex')]
      .filter(e => !e.querySelector('mjx-container')).map(e => e.textContent.slice(0, 60)),
    scrolling: [...document.querySelectorAll('.md-content pre, .md-content pre > code')]
      .filter(e => e.scrollWidth > e.clientWidth + 1)
      .map(e => e.innerText.split('\\n').reduce((a, b) => b.length > a.length ? b : a, '')),
    links: [...document.querySelectorAll('a[href]')].map(a => a.href),
    ids: [...document.querySelectorAll('[id]')].map(e => e.id),
    pageWidth: document.documentElement.scrollWidth,
  };
}"""


def visit(context, url: str, host: str | None) -> PageReport:
    return read(*open_page(context, url, host))


def open_page(context, url: str, host: str | None):
    """A new tab that starts loading ``url``, every request and error it makes recorded."""
    report = PageReport(url)
    page = context.new_page()
    page.on("console", lambda m: m.type == "error" and report.console_errors.append(m.text))
    page.on("pageerror", lambda e: report.console_errors.append(str(e)))
    page.on("requestfailed", lambda r: report.bad_requests.append(f"failed: {r.url}"))
    page.on("response", lambda r: r.status >= 400 and report.bad_requests.append(
        f"{r.status}: {r.url}"))

    def off_host(request):
        scheme, netloc = urlparse(request.url)[:2]
        if scheme not in ("data", "blob", "about") and (
                (host is None and scheme != "file") or (host is not None and netloc != host)):
            report.bad_requests.append(f"off-host: {request.url}")
    page.on("request", off_host)
    page.goto(url, wait_until="commit")
    return page, report


def read(page, report: PageReport) -> PageReport:
    """The page's facts once its network is idle (what loads late, such as the search index,
    has been requested and answered)."""
    page.wait_for_load_state("networkidle")
    report.facts = page.evaluate(READ_PAGE)
    page.close()
    return report


@pytest.fixture(scope="session")
def desktop(chromium, site, server) -> dict[str, PageReport]:
    """Every page, visited once at 1280x800; the tests below read the reports."""
    context = chromium.new_context(viewport=DESKTOP)
    host = urlparse(server).netloc
    # every tab first, then each read: the pages load side by side, and the half second of
    # quiet that "network idle" waits for passes for all of them at once
    opened = {path: open_page(context, server + path, host) for path in page_paths(site)}
    reports = {path: read(*tab) for path, tab in opened.items()}
    context.close()
    return reports


def problems(reports: dict[str, PageReport], what) -> dict[str, list]:
    found = {path: what(report) for path, report in reports.items()}
    return {path: items for path, items in found.items() if items}


def test_the_site_has_its_pages(desktop):
    assert "" in desktop and any(p.startswith("chapters/") for p in desktop), sorted(desktop)


def test_no_console_error(desktop):
    assert problems(desktop, lambda r: r.console_errors) == {}


def test_no_failed_or_off_host_request(desktop):
    assert problems(desktop, lambda r: r.bad_requests) == {}


def test_every_image_loads(desktop):
    assert problems(desktop, lambda r: [i["src"] for i in r.facts["images"]
                                        if not i["loaded"]]) == {}


def test_every_formula_is_typeset(desktop):
    assert problems(desktop, lambda r: r.facts["mathUntypeset"]) == {}
    assert problems(desktop, lambda r: re.findall(r"\\[(\[].{0,40}", r.facts["prose"])) == {}


def test_no_placeholder_or_snippet_marker_is_left(desktop):
    leftover = re.compile(r"\{\{\s*(?:result|provenance)|--8<--")
    assert problems(desktop, lambda r: leftover.findall(r.facts["text"])) == {}


def test_no_listing_side_scrolls_on_a_desktop(desktop):
    assert problems(desktop, lambda r: r.facts["scrolling"]) == {}


def test_figures_are_shown_large_enough(desktop):
    small, drawn_wide = {}, set()
    for path, report in desktop.items():
        for img in report.facts["images"]:
            if not img["figure"] or not img["natural"]:
                continue
            name = img["src"].split("figures/")[-1]
            scale = img["width"] / img["natural"]
            if name in DRAWN_WIDER_THAN_THE_COLUMN:
                drawn_wide.add(name)
                # it cannot reach 80 %: it must at least fill the column
                if img["width"] < report.facts["column"] - 1:
                    small[f"{path} {name}"] = f"{img['width']} px, column {report.facts['column']}"
            elif scale < 0.8:
                small[f"{path} {name}"] = f"{scale:.0%} of {img['natural']} px"
    assert small == {}
    assert drawn_wide <= DRAWN_WIDER_THAN_THE_COLUMN


def test_every_internal_link_and_anchor_resolves(desktop, server):
    ids = {urljoin(server, path): set(r.facts["ids"]) for path, r in desktop.items()}
    broken, fetched = [], {}
    for path, report in desktop.items():
        for href in report.facts["links"]:
            if not href.startswith(server):
                continue
            target, anchor = urldefrag(href)
            if target in ids:
                if anchor and anchor not in ids[target]:
                    broken.append(f"{path} -> {href} (no such anchor)")
                continue
            if target not in fetched:
                try:
                    with urllib.request.urlopen(target, timeout=10) as response:
                        fetched[target] = response.status
                except OSError as err:
                    fetched[target] = str(err)
            if fetched[target] != 200:
                broken.append(f"{path} -> {href} ({fetched[target]})")
    assert broken == []


def test_pages_do_not_side_scroll_on_a_phone(chromium, site, server):
    context = chromium.new_context(viewport=PHONE, is_mobile=True, has_touch=True)
    page = context.new_page()
    wide = {}
    for path in page_paths(site):
        page.goto(server + path, wait_until="load")
        width = page.evaluate("document.documentElement.scrollWidth")
        if width > PHONE["width"] + 1:
            wide[path] = width
    context.close()
    assert wide == {}


def test_a_figure_opens_at_full_size_on_a_click(chromium, server, desktop):
    path = next(p for p, r in desktop.items() if any(i["figure"] for i in r.facts["images"]))
    page = chromium.new_page(viewport=DESKTOP)
    page.goto(server + path, wait_until="networkidle")
    figure = page.locator(".md-content img").first
    figure.scroll_into_view_if_needed()
    figure.click()
    full = page.locator(".figure-zoom img")
    full.wait_for(state="visible", timeout=5000)
    natural = page.evaluate("document.querySelector('.figure-zoom img').naturalWidth")
    assert full.bounding_box()["width"] == pytest.approx(natural, abs=1)
    page.keyboard.press("Escape")
    assert page.locator(".figure-zoom").count() == 0
    page.close()


def test_dark_mode_toggles(chromium, server):
    page = chromium.new_page(viewport=DESKTOP, color_scheme="light")
    page.goto(server, wait_until="networkidle")

    def scheme():
        return page.evaluate("[document.body.dataset.mdColorScheme, "
                             "getComputedStyle(document.body).backgroundColor]")
    light = scheme()
    page.locator("label.md-header__button[for^='__palette']:visible").first.click()
    page.wait_for_function("document.body.dataset.mdColorScheme === 'slate'", timeout=5000)
    dark = scheme()
    page.close()
    assert light[0] == "default" and dark[0] == "slate"
    assert light[1] != dark[1], "the background did not change"


# --- search ---------------------------------------------------------------------------------------

IDENTIFIER = re.compile(r"\b[A-Za-z][A-Za-z0-9]*_[A-Za-z0-9_]*[A-Za-z0-9]\b")


def search(page, query: str) -> set[str]:
    """Type into the site's search box; the paths of the pages it lists (every result loaded)."""
    box = page.locator("input.md-search__input")
    meta = "document.querySelector('.md-search-result__meta').textContent"
    # Material searches on a key press, not on the input's value: empty the box with one, then
    # type the query's last character. Between the two, the count is gone, so the one read
    # below is this query's, not the last one's.
    box.fill("x")
    box.press("Backspace")
    page.wait_for_function(f"!/\\d|No /.test({meta})", timeout=10_000)
    box.fill(query[:-1])
    box.press(query[-1])
    page.wait_for_function(f"/\\d|No /.test({meta})", timeout=10_000)
    items, count = page.locator(".md-search-result__item"), -1
    while 0 < (shown := items.count()) != count:  # Material renders more as the list scrolls
        count = shown
        items.last.scroll_into_view_if_needed()
        page.wait_for_timeout(200)
    hrefs = page.eval_on_selector_all("a.md-search-result__link", "as => as.map(a => a.href)")
    return {urlparse(urldefrag(h)[0]).path.lstrip("/") for h in hrefs}


@pytest.fixture(scope="module")
def search_page(chromium, server, desktop):
    page = chromium.new_page(viewport=DESKTOP)
    page.goto(server, wait_until="networkidle")
    page.locator("input.md-search__input").click()
    yield page
    page.close()


def pages_containing(desktop, word: str) -> set[str]:
    pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(word)}", re.IGNORECASE)
    return {path for path, r in desktop.items() if pattern.search(r.facts["text"])}


@pytest.mark.parametrize("word", ["all_reduce", "straggler"])
def test_search_finds_every_page_that_contains_a_word(search_page, desktop, word):
    assert pages_containing(desktop, word) - search(search_page, word) == set()


def test_search_finds_each_chapter_by_a_code_name_it_contains(search_page, desktop):
    """For each chapter, the rarest identifier of its text (a word with an '_')."""
    found_in = Counter(name for r in desktop.values()
                       for name in set(IDENTIFIER.findall(r.facts["text"])))
    missed = {}
    for path, report in desktop.items():
        if not path.startswith("chapters/"):
            continue
        names = sorted(set(IDENTIFIER.findall(report.facts["text"])),
                       key=lambda n: (found_in[n], -len(n), n))
        assert names, f"{path} has no code name to search for"
        if path not in search(search_page, names[0]):
            missed[path] = names[0]
    assert missed == {}


# --- the offline build, from file:// --------------------------------------------------------------

@pytest.fixture(scope="session")
def offline_site(tmp_path_factory, chromium) -> Path:
    out = tmp_path_factory.mktemp("offline")
    archive = build_offline(out)
    unzipped = tmp_path_factory.mktemp("unzipped")
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(unzipped)
    return unzipped / "site-offline"


def test_offline_build_links_only_to_files(offline_site):
    """From file://, a link to a directory shows a directory listing: every link names a file."""
    href = re.compile(r"""<a\s[^>]*href="([^"#?]+)[^"]*\"""")
    broken = []
    for html in offline_site.rglob("*.html"):
        for link in href.findall(html.read_text()):
            if not re.match(r"[a-z]+:", link) and not (html.parent / link).is_file():
                broken.append(f"{html.relative_to(offline_site)} -> {link}")
    assert broken == []


def test_offline_build_navigates_and_searches_from_file_urls(chromium, offline_site):
    context = chromium.new_context(viewport=DESKTOP)
    home = visit(context, (offline_site / "index.html").as_uri(), host=None)
    assert home.console_errors == [] and home.bad_requests == []
    page = context.new_page()
    page.goto((offline_site / "index.html").as_uri(), wait_until="load")
    page.locator(".md-nav--primary a.md-nav__link[href*='chapters/']").first.click()
    page.wait_for_load_state("load")
    assert page.url.endswith(".html") and page.locator(".md-content h1").count() == 1
    chapter = visit(context, page.url, host=None)
    assert chapter.console_errors == [] and chapter.bad_requests == []
    page.locator("input.md-search__input").click()
    assert search(page, "all_reduce"), "search found nothing from file://"
    context.close()


def test_the_workshop_handout_prints_one_session_a_sheet(chromium, server):
    """The handout is built from the workshop plan and the pages; printed, each session starts
    a new sheet and the site's navigation is left out."""
    import workshop  # tools/workshop.py

    sessions = len(workshop.sessions_with_a_chapter())
    page = chromium.new_page(viewport=DESKTOP)
    page.goto(server + "handout/", wait_until="networkidle")
    assert page.locator(".handout-session").count() == sessions
    assert page.locator(".handout-session img").count() == sum(
        1 for s in workshop.sessions_with_a_chapter() if s.show)
    page.emulate_media(media="print")
    styles = page.evaluate("""() => [
        getComputedStyle(document.querySelector('.md-header')).display,
        getComputedStyle(document.querySelector('.md-sidebar')).display,
        getComputedStyle(document.querySelectorAll('.handout-session')[1]).breakBefore]""")
    assert styles == ["none", "none", "page"]
    pdf = page.pdf(format="A4")
    page.close()
    sheets = pdf.count(b"/Type /Page") - pdf.count(b"/Type /Pages")
    assert sheets >= sessions

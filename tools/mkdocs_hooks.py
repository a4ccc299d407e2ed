"""MkDocs hooks that keep the site and the runs one truth.

1. The committed ``figures/`` directory (written by the chapter scripts) is published at
   ``<site>/figures/``, so a page shows exactly the figure a reader regenerates with
   ``make run-chapterNN``.  Pages link to it as ``../figures/chapter01/ranks.png``.
2. Numbers in the prose come from ``figures/chapterNN/results.json``:

   ``{{ result 05 ratio_to_native.bucketed .3f }}``
       the value at that dotted key path, with an optional Python format spec;
   ``{{ provenance 05 }}``
       one sentence: the hardware, backend, world size, torch and commit the numbers came from.

   A missing file or key stops the build (with ``--strict`` or not): a page never shows a number
   that no run produced.
3. Tables of chapters come from the one chapter registry, ``scripts/chapters.py``:
   ``{{ chapters index }}`` (the index's table) and ``{{ chapters gpu }}`` (running.md's table);
   the workshop's from its plan, ``tools/workshop.py``: ``{{ workshop day 1 }}`` (a day's
   timetable), ``{{ workshop show 03 }}`` (the figures to project) and ``{{ workshop handout }}``.
4. A notebook page (mkdocs-jupyter) loses the ``<script>`` its template adds for MathJax: the site
   loads its own MathJax on every page.  That script's ``src`` is mkdocs.yml's
   ``custom_mathjax_url``, the same for every notebook page, so no one relative path could be right
   both at ``results/`` (hosted) and at ``results.html`` (offline build).
"""

from __future__ import annotations

import json
import re
import sys
from functools import cache
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "figures"
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tools")]
import workshop  # noqa: E402  (tools/workshop.py, the workshop's plan)

import chapters  # noqa: E402  (scripts/chapters.py, the chapter registry)

TABLES = {
    ("chapters", "index"): lambda _arg: chapters.index_table(),
    ("chapters", "gpu"): lambda _arg: chapters.gpu_table(),
    ("workshop", "day"): lambda arg: workshop.timetable(int(arg)),
    ("workshop", "show"): lambda arg: workshop.show(int(arg)),
    ("workshop", "handout"): lambda _arg: workshop.handout(),
}
TABLE = re.compile(r"\{\{\s*(chapters|workshop)\s+(\w+)(?:\s+(\d+))?\s*\}\}")
NOTEBOOK_MATHJAX = '<script src="notebook-mathjax-removed-by-hook.js"> </script>'
PLACEHOLDER = re.compile(r"\{\{\s*(result|provenance)\s+(\d{2}|bench)(?:\s+([^\s}]+))?"
                         r"(?:\s+([^\s}]+))?\s*\}\}")


def on_files(files: Files, config) -> Files:
    for path in sorted(FIGURES.rglob("*")):
        if path.is_file() and not path.name.startswith("."):
            uri = (Path("figures") / path.relative_to(FIGURES)).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    def replace(match: re.Match) -> str:
        try:
            return render(*match.groups())
        except (KeyError, FileNotFoundError, ValueError, TypeError) as err:
            raise PluginError(f"{page.file.src_uri}: {match.group(0)}: {err}") from None

    def table(match: re.Match) -> str:
        source, name, arg = match.groups()
        if (source, name) not in TABLES:
            known = ", ".join(" ".join(key) for key in TABLES)
            raise PluginError(f"{page.file.src_uri}: {match.group(0)}: no such table ({known})")
        try:
            return TABLES[source, name](arg)
        except (KeyError, ValueError, TypeError, FileNotFoundError) as err:
            raise PluginError(f"{page.file.src_uri}: {match.group(0)}: {err}") from None
    return PLACEHOLDER.sub(replace, TABLE.sub(table, markdown))


def render(kind: str, chapter: str, key: str | None, spec: str | None) -> str:
    results = load_results(chapter)
    if kind == "provenance":
        return describe_provenance(results["provenance"])
    if key is None:
        raise ValueError("`result` needs a key, e.g. {{ result 05 step_time_ms.native .1f }}")
    value = lookup(results, key)
    return format(value, spec) if spec else str(value)


@cache
def load_results(chapter: str) -> dict:
    """``NN``: figures/chapterNN/results.json; ``bench``: figures/bench/results.json, the
    --quick and grading times ``make bench ARGS=--record`` measured."""
    folder, command = ((f"chapter{chapter}", f"make run-chapter{chapter}") if chapter.isdigit()
                       else (chapter, "make bench ARGS=--record"))
    path = FIGURES / folder / "results.json"
    if not path.exists():
        raise FileNotFoundError(f"{path.relative_to(ROOT)} does not exist: run "
                                f"`{command}` and commit its output")
    return json.loads(path.read_text())


def lookup(results: dict, dotted: str):
    value = results
    for part in dotted.split("."):
        if isinstance(value, list):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise KeyError(f"results.json has no key {dotted!r} (stopped at {part!r})")
    return value


def describe_provenance(p: dict) -> str:
    ranks = f"{p['world_size']} rank{'s' if p['world_size'] != 1 else ''}"
    where = "GPU" if p["backend"] == "nccl" else f"CPU, {p['cpu_count']} cores"
    quick = " (--quick)" if p.get("quick") else ""
    return (f"*Measured on {p['device']} ({where}), {ranks} on {p['backend']}, "
            f"torch {p['torch']}, launched by {p['launcher']}, {p['date'][:10]}, "
            f"commit `{p['git_commit']}`{quick}.*")


def on_post_page(output: str, page, config) -> str:
    if not page.file.src_uri.endswith(".ipynb"):
        return output
    if NOTEBOOK_MATHJAX not in output:
        raise PluginError(f"{page.file.src_uri}: the notebook template no longer loads MathJax as "
                          f"{NOTEBOOK_MATHJAX}: check mkdocs-jupyter's custom_mathjax_url")
    return output.replace(NOTEBOOK_MATHJAX, "")

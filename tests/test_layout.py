"""The rooms of the code, and the rules that keep each line of it in its room.

    scripts/chapterNN_<slug>.py, hello_ddp.py   a chapter's story and its own flags
    scripts/ddplab/        what the reader builds: one concept per module
    scripts/ddplab/run/    how a chapter runs: launch, flags, results.json, timing, plotting
    scripts/backstage/     one chapter's plumbing that is not its story:
                           chapterNN.py, or chapterNN_<what>.py where a chapter has several
    scripts/drawing/       each chapter's figures, a pure function of its results.json
    tests/, tools/         outside the rooms: they may import any of them

The rules (read from the source with ``ast``: no torch is imported here):

1. ``ddplab.run`` imports no concept, no backstage and no drawing: any chapter can use it, and
   it teaches nothing.
2. A concept imports no backstage, no drawing and not ``argparse``: what the reader builds
   takes arguments, not flags.
3. ``backstage/chapterNN*`` is imported only by ``scripts/chapterNN_*.py``, by the backstage
   and the drawing of the same chapter, and by tests and tools.
4. Drawing imports no concept and no other chapter's backstage: a figure is drawn from
   results.json, in the words its chapter's backstage gives the numbers (labels flow from the
   report to the drawing, never back).  One exception is named in ``DRAWING_MAY_IMPORT``.
5. A script (scripts/*.py) and a backstage module are at most 450 lines; a module of ddplab,
   ddplab.run or drawing at most 350.
6. Every chapter of ``scripts/chapters.py`` has its nav entry in mkdocs.yml, its page, its
   script, its ``tests/test_chapterNN.py`` and, when its committed figures hold a PNG, its
   drawing module; every script, page, drawing module, backstage module and chapter test
   belongs to a chapter of the registry.
7. Every snippet section (``# --8<-- [start:name]``) is included by a page.
8. No comment or docstring tells the code's history (issue numbers, numbered stops, findings
   of CI, the words of those who read it over): the code says what it does and why; git keeps
   the history.
9. Each room's ``__init__.py`` docstring is a map that names every module in the room.
10. A chapter's own flags are defined in its script (no ``add_argument`` in backstage), and no
    script's ``main()`` repeats the skeleton that ``ddplab.run.chapter_main`` holds (``replot``
    ... ``chapter_output``).

Each rule is a function of a tree's root, so that each is shown to fail on a small made-up tree.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest
from conftest import REPO

SCRIPT_LINES, BACKSTAGE_LINES, MODULE_LINES = 450, 450, 350

# drawing module -> the concept it may import, and why.
DRAWING_MAY_IMPORT = {
    ("drawing.chapter06", "ddplab.stragglers"):
        "the bubble drawn is the idle time as stragglers.idle_events defines it; computing it "
        "again in the drawing would copy the concept's rule",
}

HISTORY = [
    re.compile(r"\bissues?\s*#?\d{1,3}\b(?!\d)", re.IGNORECASE),  # ours, not pytorch/pytorch#NNNNN
    re.compile(r"\bthe issue(?:'s)?\b", re.IGNORECASE),
    re.compile(r"\bstops?\s*#?\d+\b", re.IGNORECASE),
    re.compile(r"\bCI\s+(?:run|showed|found|caught|saw|failed|flagged)\b"),
    re.compile(r"\b(?:the|a|this|that|last|first|after)\s+review\b|\breviewers?\b",
               re.IGNORECASE),
]


# --- reading a tree -----------------------------------------------------------------------------

def python_files(root: Path, *folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (root / folder).rglob("*.py")
                  if "__pycache__" not in p.parts)


def module_name(root: Path, path: Path) -> str | None:
    """``ddplab.run.launch`` for scripts/ddplab/run/launch.py; None outside scripts/."""
    try:
        parts = list(path.relative_to(root / "scripts").with_suffix("").parts)
    except ValueError:
        return None
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str | None) -> str | None:
    if module is None:
        return None
    top = module.split(".")[0]
    if module == "ddplab.run" or module.startswith("ddplab.run."):
        return "run"
    if top in ("ddplab", "backstage", "drawing"):
        return {"ddplab": "concept"}.get(top, top)
    if re.fullmatch(r"chapter\d\d_\w+|hello_ddp", module):
        return "script"
    return None


def imports(root: Path, path: Path) -> list[tuple[int, str]]:
    """(line, absolute name) of everything ``path`` imports; ``from X import a`` gives X.a."""
    module = module_name(root, path) or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join([*base, source] if source else base)
            found += [(node.lineno, f"{source}.{alias.name}") for alias in node.names]
    return found


def backstage_chapter(module: str) -> str | None:
    m = re.match(r"backstage\.chapter(\d\d)(?:_\w+)?(?:\.|$)", module)
    return m[1] if m else None


def drawing_chapter(module: str) -> str | None:
    m = re.match(r"drawing\.chapter(\d\d)$", module)
    return m[1] if m else None


def where(root: Path, path: Path, line: int) -> str:
    return f"{path.relative_to(root).as_posix()}:{line}"


# --- the rules ----------------------------------------------------------------------------------

def room_violations(root: Path) -> list[str]:
    """Rules 1, 2 and 4: what each room may import."""
    out = []
    for path in python_files(root, "scripts"):
        module = module_name(root, path)
        mine = room(module)
        for line, name in imports(root, path):
            theirs = room(name)
            if mine == "run" and theirs in ("concept", "backstage", "drawing"):
                out.append(f"{where(root, path, line)}: ddplab.run imports {name} ({theirs})")
            elif mine == "concept" and (theirs in ("backstage", "drawing") or
                                        name.split(".")[0] == "argparse"):
                out.append(f"{where(root, path, line)}: the concept {module} imports {name}")
            elif mine == "drawing" and (theirs == "concept" or (
                    theirs == "backstage" and backstage_chapter(name) != drawing_chapter(module))
                    ) and not any(
                    module == drawing and (name == allowed or name.startswith(allowed + "."))
                    for drawing, allowed in DRAWING_MAY_IMPORT):
                out.append(f"{where(root, path, line)}: the drawing {module} imports {name}")
    return out


def backstage_violations(root: Path) -> list[str]:
    """Rule 3: a chapter's backstage is its own."""
    out = []
    for path in python_files(root, "scripts", "exercises"):
        module = module_name(root, path) or path.relative_to(root).as_posix()
        for line, name in imports(root, path):
            chapter = backstage_chapter(name)
            if chapter is None:
                continue
            if chapter in (backstage_chapter(module), drawing_chapter(module)) or re.fullmatch(
                    rf"chapter{chapter}_\w+", module):
                continue
            out.append(f"{where(root, path, line)}: {module} imports chapter {chapter}'s "
                       f"backstage ({name})")
    return out


def size_violations(root: Path) -> list[str]:
    """Rule 5."""
    out = []
    for path in python_files(root, "scripts"):
        parts = path.relative_to(root / "scripts").parts
        limit = (SCRIPT_LINES if len(parts) == 1 else
                 BACKSTAGE_LINES if parts[0] == "backstage" else MODULE_LINES)
        lines = len(path.read_text().splitlines())
        if lines > limit:
            out.append(f"{path.relative_to(root).as_posix()}: {lines} lines (at most {limit})")
    return out


def load_registry(root: Path):
    spec = importlib.util.spec_from_file_location(f"registry_{id(root)}",
                                                  root / "scripts" / "chapters.py")
    registry = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = registry  # a dataclass looks its module up there
    try:
        spec.loader.exec_module(registry)
    finally:
        del sys.modules[spec.name]
    return registry.CHAPTERS


def chapter_test(nn: str) -> str:
    return "tests/test_hello_ddp.py" if nn == "00" else f"tests/test_chapter{nn}.py"


def registry_violations(root: Path) -> list[str]:
    """Rule 6, both ways: what a chapter must have, and nothing without a chapter."""
    chapters = load_registry(root)
    nav = (root / "mkdocs.yml").read_text()
    out = []
    for c in chapters:
        needs = [c.script, f"docs/{c.page}", chapter_test(c.nn)]
        if any((root / "figures" / f"chapter{c.nn}").glob("*.png")):
            needs.append(f"scripts/drawing/chapter{c.nn}.py")
        out += [f"chapter {c.nn}: {need} is missing" for need in needs
                if not (root / need).is_file()]
        if not re.search(rf":\s*{re.escape(c.page)}\s*$", nav, re.MULTILINE):
            out.append(f"chapter {c.nn}: mkdocs.yml's nav has no entry for {c.page}")
    known = {c.nn for c in chapters}
    for pattern in ("scripts/chapter[0-9][0-9]_*.py", "docs/chapters/[0-9][0-9]-*.md",
                    "scripts/drawing/chapter[0-9][0-9].py",
                    "scripts/backstage/chapter[0-9][0-9]*.py", "tests/test_chapter[0-9][0-9]*.py"):
        for path in sorted(root.glob(pattern)):
            nn = re.search(r"(\d\d)", path.name)[1]
            if nn not in known:
                out.append(f"{path.relative_to(root).as_posix()}: no chapter {nn} in "
                           "scripts/chapters.py")
    return out


SECTION = re.compile(r"--8<--\s*\[start:([\w-]+)\]")
INCLUDE = re.compile(r"""--8<--\s+["']([^"':]+):([\w-]+)["']""")


def unused_snippets(root: Path) -> list[str]:
    """Rule 7: every section a file marks is listed on a page."""
    included = {(m[1], m[2]) for page in sorted((root / "docs").rglob("*.md"))
                for m in INCLUDE.finditer(page.read_text())}
    out = []
    for folder in ("scripts", "exercises", "recipes", "tools"):
        for path in sorted((root / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            rel = path.relative_to(root).as_posix()
            for number, line in enumerate(text.splitlines(), 1):
                m = SECTION.search(line)
                if m and (rel, m[1]) not in included:
                    out.append(f"{rel}:{number}: section {m[1]!r} is included by no page")
    return out


def comments_and_docstrings(path: Path):
    """(line, text) of every comment and docstring in a Python file."""
    text = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc


def history_comments(root: Path) -> list[str]:
    """Rule 8."""
    out = []
    for path in python_files(root, "scripts", "tests", "tools", "exercises"):
        for line, text in comments_and_docstrings(path):
            for pattern in HISTORY:
                m = pattern.search(text)
                if m:
                    out.append(f"{where(root, path, line)}: {m[0]!r} in {text.strip()[:70]!r}")
    return out


ROOMS = ("ddplab", "ddplab/run", "backstage", "drawing")


def unmapped_modules(root: Path) -> list[str]:
    """Rule 9: a package's docstring names each of its modules (``x.py``, or ``sub/``)."""
    out = []
    for package in ROOMS:
        folder = root / "scripts" / package
        if not (folder / "__init__.py").is_file():
            continue
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        names = [p.name for p in sorted(folder.glob("*.py")) if p.name != "__init__.py"]
        names += [f"{p.name}/" for p in sorted(folder.iterdir()) if (p / "__init__.py").is_file()
                  and f"{package}/{p.name}" not in ROOMS]
        out += [f"scripts/{package}/__init__.py does not name {name}" for name in names
                if not re.search(rf"(?<![\w/]){re.escape(name)}", doc)]
    return out


def functions_called(node: ast.AST) -> set[str]:
    return {(n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", ""))
            for n in ast.walk(node) if isinstance(n, ast.Call)}


def flags_outside_scripts(root: Path) -> list[str]:
    """Rule 10, the flags: a chapter's own flags are in its script.  A hidden flag
    (``help=argparse.SUPPRESS``: what a script passes to the copies of itself it starts, never
    typed by a reader) may live with the plumbing that uses it."""
    return [f"{where(root, path, node.lineno)}: defines a flag ({node.func.attr})"
            for path in python_files(root, "scripts/backstage")
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("add_argument", "add_mutually_exclusive_group")
            and not hidden_flag(node)]


def hidden_flag(call: ast.Call) -> bool:
    return any(k.arg == "help" and isinstance(k.value, ast.Attribute)
               and k.value.attr == "SUPPRESS" for k in call.keywords)


def copied_mains(root: Path) -> list[str]:
    """Rule 10, the main: the skeleton from --replot to the chapter's output is written once."""
    out = []
    for path in sorted((root / "scripts").glob("chapter[0-9][0-9]_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == "main" and \
                    {"replot", "chapter_output"} <= functions_called(node):
                out.append(f"{where(root, path, node.lineno)}: main() repeats the chapter "
                           "skeleton (replot ... chapter_output): call ddplab.run.chapter_main")
    return out


# --- the repository keeps the rules -------------------------------------------------------------

def test_each_room_imports_only_what_it_may():
    assert room_violations(REPO) == []


def test_a_chapters_backstage_is_imported_by_that_chapter_only():
    assert backstage_violations(REPO) == []


def test_scripts_and_modules_stay_short():
    assert size_violations(REPO) == []


def test_every_chapter_has_its_row_nav_page_script_drawing_and_tests():
    assert registry_violations(REPO) == []


def test_every_snippet_section_is_included_by_a_page():
    assert unused_snippets(REPO) == []


def test_no_comment_or_docstring_tells_the_codes_history():
    assert history_comments(REPO) == []


def test_each_rooms_docstring_maps_every_module():
    assert unmapped_modules(REPO) == []


def test_a_chapters_own_flags_are_in_its_script():
    assert flags_outside_scripts(REPO) == []


def test_no_chapter_script_copies_the_main_skeleton():
    assert copied_mains(REPO) == []


# --- each rule fails on a tree that breaks it ---------------------------------------------------

def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_run_importing_a_concept_is_named(tmp_path):
    write(tmp_path, {"scripts/ddplab/run/launch.py": "from ..costmodel import ring_time\n",
                     "scripts/ddplab/run/cli.py": "from . import devices\nimport argparse\n"})
    assert room_violations(tmp_path) == [
        "scripts/ddplab/run/launch.py:1: ddplab.run imports ddplab.costmodel.ring_time (concept)"]


def test_a_concept_with_flags_or_figures_is_named(tmp_path):
    write(tmp_path, {"scripts/ddplab/ring.py": "import argparse\nfrom drawing import chapter03\n"
                                               "from .run.timing import median\n"})
    assert room_violations(tmp_path) == [
        "scripts/ddplab/ring.py:1: the concept ddplab.ring imports argparse",
        "scripts/ddplab/ring.py:2: the concept ddplab.ring imports drawing.chapter03"]


def test_drawing_a_concept_is_named_unless_excepted(tmp_path):
    write(tmp_path, {"scripts/drawing/chapter05.py": "from ddplab import NaiveDDP\n",
                     "scripts/drawing/chapter06.py": "from ddplab import stragglers\n"})
    assert room_violations(tmp_path) == [
        "scripts/drawing/chapter05.py:1: the drawing drawing.chapter05 imports ddplab.NaiveDDP"]


def test_a_drawing_takes_words_from_its_own_chapters_backstage_only(tmp_path):
    drawing = "from backstage.chapter05_report import LABELS\nfrom backstage.chapter03 import x\n"
    write(tmp_path, {"scripts/drawing/chapter05.py": drawing})
    assert room_violations(tmp_path) == [
        "scripts/drawing/chapter05.py:2: the drawing drawing.chapter05 imports "
        "backstage.chapter03.x"]
    assert backstage_violations(tmp_path) == [
        "scripts/drawing/chapter05.py:2: drawing.chapter05 imports chapter 03's backstage "
        "(backstage.chapter03.x)"]


def test_another_chapters_backstage_is_named(tmp_path):
    write(tmp_path, {"scripts/chapter05_x.py": "from backstage import chapter06_report\n"
                                               "from backstage.chapter05 import summary\n",
                     "scripts/backstage/chapter06_a.py": "from .chapter06_b import x\n",
                     "scripts/ddplab/ring.py": "import backstage.chapter03\n"})
    assert backstage_violations(tmp_path) == [
        "scripts/chapter05_x.py:1: chapter05_x imports chapter 06's backstage "
        "(backstage.chapter06_report)",
        "scripts/ddplab/ring.py:1: ddplab.ring imports chapter 03's backstage "
        "(backstage.chapter03)"]


def test_a_long_file_is_named_with_its_limit(tmp_path):
    write(tmp_path, {"scripts/chapter01_a.py": "\n" * 451, "scripts/ddplab/run/x.py": "\n" * 351,
                     "scripts/backstage/chapter01.py": "\n" * 450, "scripts/drawing/y.py": "\n"})
    assert size_violations(tmp_path) == [
        "scripts/chapter01_a.py: 451 lines (at most 450)",
        "scripts/ddplab/run/x.py: 351 lines (at most 350)"]


REGISTRY = """
from dataclasses import dataclass
@dataclass
class Chapter:
    number: int
    slug: str
    @property
    def nn(self): return f"{self.number:02d}"
    @property
    def script(self): return f"scripts/chapter{self.nn}_{self.slug}.py"
    @property
    def page(self): return f"chapters/{self.nn}-{self.slug}.md"
CHAPTERS = (Chapter(1, "one"), Chapter(2, "two"))
"""


def test_a_chapter_missing_anything_is_named(tmp_path):
    write(tmp_path, {"scripts/chapters.py": REGISTRY,
                     "mkdocs.yml": "nav:\n  - 01 One: chapters/01-one.md\n",
                     "scripts/chapter01_one.py": "", "scripts/chapter02_two.py": "",
                     "docs/chapters/01-one.md": "", "docs/chapters/02-two.md": "",
                     "tests/test_chapter01.py": "", "figures/chapter01/a.png": "",
                     "scripts/drawing/chapter03.py": ""})
    assert registry_violations(tmp_path) == [
        "chapter 01: scripts/drawing/chapter01.py is missing",
        "chapter 02: tests/test_chapter02.py is missing",
        "chapter 02: mkdocs.yml's nav has no entry for chapters/02-two.md",
        "scripts/drawing/chapter03.py: no chapter 03 in scripts/chapters.py"]


def test_a_section_no_page_includes_is_named(tmp_path):
    write(tmp_path, {"scripts/ddplab/ring.py": "# --8<-- [start:ring]\n# --8<-- [end:ring]\n"
                                               "# --8<-- [start:old]\n# --8<-- [end:old]\n",
                     "docs/chapters/03.md": '--8<-- "scripts/ddplab/ring.py:ring"\n'})
    assert unused_snippets(tmp_path) == [
        "scripts/ddplab/ring.py:3: section 'old' is included by no page"]


@pytest.mark.parametrize("comment", [
    "# the targets of issue 10", "# see issue #7", "# the issue's probe", "# done at stop 3",
    "# the abort CI showed", "# as the reviewer asked", "# fixed after the review"])
def test_a_history_comment_is_named(tmp_path, comment):
    write(tmp_path, {"scripts/ddplab/a.py": f"x = 1  {comment}\n"})
    assert len(history_comments(tmp_path)) == 1


@pytest.mark.parametrize("comment", [
    "# pytorch/pytorch#190489", "# works over ssh and in CI", "# stop the ranks first",
    "# every rank issues the same collectives"])
def test_a_comment_about_the_code_passes(tmp_path, comment):
    write(tmp_path, {"scripts/ddplab/a.py": f'"""A module."""\nx = 1  {comment}\n'})
    assert history_comments(tmp_path) == []


def test_a_history_docstring_is_named(tmp_path):
    write(tmp_path, {"tests/test_x.py": 'def test_x():\n    """What issue 18 asked."""\n'})
    assert history_comments(tmp_path) == [
        "tests/test_x.py:2: 'issue 18' in 'What issue 18 asked.'"]


def test_a_module_missing_from_its_rooms_map_is_named(tmp_path):
    write(tmp_path, {"scripts/ddplab/__init__.py": '"""ring.py  the ring"""\n',
                     "scripts/ddplab/ring.py": "", "scripts/ddplab/ring_halves.py": "",
                     "scripts/ddplab/bugs/__init__.py": "",
                     "scripts/ddplab/run/__init__.py": '"""launch.py"""\n',
                     "scripts/ddplab/run/launch.py": ""})
    assert unmapped_modules(tmp_path) == [
        "scripts/ddplab/__init__.py does not name ring_halves.py",
        "scripts/ddplab/__init__.py does not name bugs/"]


def test_flags_in_backstage_and_a_copied_main_are_named(tmp_path):
    write(tmp_path, {
        "scripts/backstage/chapter07.py": "def add_flags(p):\n    p.add_argument('--x')\n"
                                          "    p.add_argument('--y', help=argparse.SUPPRESS)\n",
        "scripts/chapter07_a.py": "def main():\n    if a:\n        replot()\n"
                                  "    with ddplab.chapter_output() as out:\n        pass\n",
        "scripts/chapter08_b.py": "def main():\n    return chapter_main(parse())\n"})
    assert flags_outside_scripts(tmp_path) == [
        "scripts/backstage/chapter07.py:2: defines a flag (add_argument)"]
    assert copied_mains(tmp_path) == [
        "scripts/chapter07_a.py:1: main() repeats the chapter skeleton (replot ... "
        "chapter_output): call ddplab.run.chapter_main"]

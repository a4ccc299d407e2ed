"""The workshop's plan, written once: its two days, each session's length and what to project.

The instructor's guide (docs/workshop.md) renders its timetables and its "Show" lines from here,
and the printable handout (docs/handout.md) is built from the plan and the chapter pages:
each session's commands, its key figure and the page's check questions, so nothing is typed
twice.  A demo's length comes from the measured `--quick` time in figures/bench/results.json
(`make bench ARGS=--record`); the other lengths are the plan's.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import chapters  # noqa: E402  (scripts/chapters.py, the chapter registry)

DAY_STARTS_AT = 9 * 60  # minutes after midnight
DAY_MUST_END_BY = 17 * 60 + 30
READING_THE_OUTPUT_MIN = 3  # a demo: the run, then the room reads its output together


@dataclass(frozen=True)
class Session:
    title: str
    chapter: int | None = None  # a chapter of the registry, or None (set-up, breaks, wrap-up)
    core_min: int = 0  # the page's core idea, talked through
    exercise_min: int = 0  # the room does the exercises and grades them
    review_min: int = 0  # the instructor goes through the common mistakes
    show: tuple[str, ...] = ()  # figures/ paths to project; the first is the handout's figure
    fixed_min: int = 0  # a session without a demo: set-up, a break, lunch, a wrap-up

    @property
    def has_demo(self) -> bool:
        return self.chapter is not None


def Break(minutes: int, title: str = "*break*") -> Session:
    return Session(title, fixed_min=minutes)


DAYS: dict[int, tuple[Session, ...]] = {
    1: (
        Session("Set-up check", fixed_min=20),
        Session("Hello, DDP", 0, core_min=10, review_min=10),
        Session("Processes and ranks", 1, 10, 25, 10,
                ("chapter01/ranks.png", "chapter01/replicas.png")),
        Break(15),
        Session("Collectives", 2, 10, 30, 10,
                ("diagrams/allreduce_decomposed.png", "chapter02/reduce_scatter.png")),
        Session("Ring all-reduce", 3, 15, 45, 10, ("chapter03/ring_steps.png",
                                                   "chapter03/busbw.png")),
        Break(60, "*lunch*"),
        Session("Data-parallel training", 5, 20, 50, 10,
                ("diagrams/overlap_timelines.png", "chapter05/equivalence.png")),
        Session("Wrap-up: what day 2 adds", fixed_min=15),
    ),
    2: (
        Session("Recap of day 1", fixed_min=10),
        Session("Autograd hooks and buckets", 4, 10, 30, 10,
                ("diagrams/bucket_filling.png", "chapter04/overlap.png")),
        Session("Bubbles and stragglers", 6, 10, 15, 10,
                ("chapter06/straggler_timeline.png", "chapter06/straggler.png")),
        Break(15),
        Session("Checkpointing and failures", 7, 10, 25, 10,
                ("chapter07/resume.png", "chapter07/restart.png")),
        Break(60, "*lunch*"),
        Session("The bug lab", 8, 10, 40, 15),
        Session("Mixed precision and compression", 9, 10, 25, 10,
                ("chapter09/training.png", "chapter09/links.png")),
        Break(15),
        Session("Many machines", 10, 10, 0, 15,
                ("diagrams/ranks_two_nodes.png", "chapter10/projection.png")),
        Session("Sharding: ZeRO and FSDP", 11, 15, 25, 10,
                ("chapter11/ledger_formula.png", "chapter11/ledger.png",
                 "chapter11/gathers.png", "chapter11/timeline.png")),
        Session("Wrap-up", fixed_min=15),
    ),
}


def bench_quick_seconds() -> dict[str, float]:
    path = ROOT / "figures" / "bench" / "results.json"
    return json.loads(path.read_text())["quick_seconds"]


def demo_command(chapter: chapters.Chapter) -> str:
    if chapter.number == 0:
        return "python scripts/hello_ddp.py"
    sudo = "sudo " if chapter.number == 10 else ""  # network namespaces need root
    return f'{sudo}make run-chapter{chapter.nn} ARGS="--quick"'


def demo_minutes(chapter: chapters.Chapter, quick_seconds: dict[str, float]) -> int:
    """The measured --quick run, rounded up to a minute, plus reading its output together.
    Hello's run is not benched: its 2-rank training takes seconds, so one minute."""
    run = quick_seconds.get(chapter.nn, 60.0) if chapter.number else 60.0
    return max(1, math.ceil(run / 60)) + READING_THE_OUTPUT_MIN


def minutes(session: Session, quick_seconds: dict[str, float]) -> int:
    if not session.has_demo:
        return session.fixed_min
    demo = demo_minutes(chapters.by_number(session.chapter), quick_seconds)
    return session.core_min + demo + session.exercise_min + session.review_min


def clock(minute_of_day: int) -> str:
    return f"{minute_of_day // 60:02d}:{minute_of_day % 60:02d}"


def schedule(day: int, quick_seconds: dict[str, float] | None = None) -> list[tuple[int, Session]]:
    """(start minute, session) for every row of a day, and the end as a last (minute, None)."""
    quick_seconds = bench_quick_seconds() if quick_seconds is None else quick_seconds
    rows, now = [], DAY_STARTS_AT
    for session in DAYS[day]:
        rows.append((now, session))
        now += minutes(session, quick_seconds)
    rows.append((now, None))
    return rows


def timetable(day: int) -> str:
    """A day's table for docs/workshop.md (links relative to docs/)."""
    quick = bench_quick_seconds()
    lines = ["| Time | Session | Live demo | Exercises |", "|---|---|---|---|"]
    for start, session in schedule(day, quick):
        if session is None:
            lines.append(f"| {clock(start)} | *end of day {day}* | | |")
        elif not session.has_demo:
            lines.append(f"| {clock(start)} | {session.title} | | |")
        else:
            ch = chapters.by_number(session.chapter)
            exercises = f"{session.exercise_min} min" if session.exercise_min else "—"
            lines.append(f"| {clock(start)} | [{ch.nn} {ch.title}]({ch.page}) | "
                         f"`{demo_command(ch)}` ({demo_minutes(ch, quick)} min) | {exercises} |")
    return "\n".join(lines)


def sessions_with_a_chapter() -> list[Session]:
    return [s for day in sorted(DAYS) for s in DAYS[day] if s.has_demo]


def session_for(chapter: int) -> Session:
    for session in sessions_with_a_chapter():
        if session.chapter == chapter:
            return session
    raise KeyError(f"no workshop session teaches chapter {chapter:02d}")


def show(chapter: int, prefix: str = "") -> str:
    """The figures to project for a chapter's session, as Markdown images."""
    session = session_for(chapter)
    if not session.show:
        return "the chapter's page: the bug lab has a symptom index, no figure"
    # Each figure a paragraph of its own, at the page's width: projected, it must be legible.
    return "\n\n" + "\n\n".join(f"![{Path(f).stem.replace('_', ' ')}]({prefix}figures/{f})"
                                 for f in session.show)


def check_questions(page: Path) -> list[str]:
    """The questions of a page's "Check your understanding" section (answers stay on the page)."""
    text = page.read_text()
    start = text.index("## Check your understanding")
    end = text.find("\n## ", start + 1)
    section = text[start:] if end < 0 else text[start:end]
    return re.findall(r'^\?\?\? question "(.+)"$', section, re.MULTILINE)


def handout() -> str:
    """One printable section per session: commands, the key figure, the check questions."""
    parts = []
    for session in sessions_with_a_chapter():
        ch = chapters.by_number(session.chapter)
        day = next(d for d in DAYS if session in DAYS[d])
        commands = [demo_command(ch)]
        if ch.exercises:
            commands.append(f"make grade-{ch.nn}   # grades exercises/chapter{ch.nn}_{ch.slug}.py")
        lines = ['<div class="handout-session" markdown>', "",
                 f"## Day {day} · {ch.nn} {ch.title}", "",
                 f"[The chapter]({ch.page}) — {ch.summary}.", "", "```bash", *commands, "```", ""]
        if session.show:
            figure = session.show[0]
            lines += [f"![{Path(figure).stem.replace('_', ' ')}](figures/{figure})", ""]
        lines += ["**Check your understanding** (answers on the chapter's page):", ""]
        lines += [f"{i}. {q}" for i, q in
                  enumerate(check_questions(ROOT / "docs" / ch.page), start=1)]
        lines += ["", "</div>", ""]
        parts.append("\n".join(lines))
    return "\n".join(parts)

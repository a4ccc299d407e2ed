"""The workshop's plan (tools/workshop.py): two days that fit, every chapter taught once, demo
lengths from the measured --quick times, and a handout built from the pages."""

from __future__ import annotations

import pytest
import workshop
from conftest import REPO

import chapters

DAY_ONE_CORE = {0, 1, 2, 3, 5}  # Hello to a DDP of one's own


def taught(day: int) -> set[int]:
    return {s.chapter for s in workshop.DAYS[day] if s.has_demo}


@pytest.mark.parametrize("day", sorted(workshop.DAYS))
def test_each_day_ends_in_time_with_the_committed_bench(day):
    end, last = workshop.schedule(day)[-1]
    assert last is None
    assert end <= workshop.DAY_MUST_END_BY, f"day {day} ends at {workshop.clock(end)}"


def test_day_one_is_the_core_and_every_chapter_is_taught_exactly_once():
    assert taught(1) == DAY_ONE_CORE
    sessions = [s.chapter for s in workshop.sessions_with_a_chapter()]
    assert sorted(sessions) == [c.number for c in chapters.CHAPTERS]


def test_a_slower_demo_moves_every_later_session():
    quick = workshop.bench_quick_seconds()
    before = dict((s.title, t) for t, s in workshop.schedule(1, quick) if s)
    slower = {**quick, "03": 150.0}  # 2.5 min: the demo takes 3 min + 3 to read its output
    after = dict((s.title, t) for t, s in workshop.schedule(1, slower) if s)
    minutes_before = workshop.demo_minutes(chapters.by_number(3), quick)
    assert after["Data-parallel training"] - before["Data-parallel training"] == 6 - minutes_before
    assert after["Ring all-reduce"] == before["Ring all-reduce"]


def test_every_figure_to_show_exists():
    for session in workshop.sessions_with_a_chapter():
        for figure in session.show:
            assert (REPO / "figures" / figure).is_file(), figure


def test_the_handout_has_every_sessions_commands_and_the_pages_questions():
    handout = workshop.handout()
    for session in workshop.sessions_with_a_chapter():
        chapter = chapters.by_number(session.chapter)
        questions = workshop.check_questions(REPO / "docs" / chapter.page)
        assert len(questions) >= 3
        assert all(q in handout for q in questions)
        assert workshop.demo_command(chapter) in handout
        if chapter.exercises:
            assert f"make grade-{chapter.nn}" in handout
    assert handout.count('<div class="handout-session"') == len(workshop.sessions_with_a_chapter())


def test_an_unknown_chapter_is_named():
    with pytest.raises(KeyError, match="no workshop session teaches chapter 42"):
        workshop.session_for(42)

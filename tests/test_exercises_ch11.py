"""Why chapter 11 grades at 3 ranks: two of its wrong solutions give fully_shard's bits at 2.

A flat parameter-major message and a gradient divided before the reduction are wrong, yet at 2
ranks an element's sum has one order (a + b == b + a) and halving is exact, so exercise 11.3
passes them there.  The same files are rejected at 3 ranks (tests/test_exercises.py), which is
the world size the grader uses.
"""

from __future__ import annotations

import pytest
from test_exercises import REPO, WRONG, assert_no_rank_left, by_id

from exercises.grader import ch11, core

pytestmark = pytest.mark.usefixtures("fork_server")  # grading ranks fork from conftest's server


def test_the_grader_uses_3_ranks_only():
    assert {ex.world_sizes for ex in ch11.EXERCISES} == {(3,)}


@pytest.mark.parametrize("name", ["ch11_smallest_first_flat_layout",
                                  "ch11_round_robin_divides_first"])
def test_the_layout_and_divide_first_mistakes_pass_at_2_ranks(name, monkeypatch):
    exercise = next(ex for ex in ch11.EXERCISES if ex.id == "11.3")
    monkeypatch.setattr(exercise, "world_sizes", (2,))
    verdict = by_id(core.grade(WRONG / f"{name}.py", 11))["11.3"]
    assert verdict.status == "ok", verdict.line()
    assert_no_rank_left()


def test_the_solution_passes_at_2_ranks_too(monkeypatch):
    for exercise in ch11.EXERCISES:
        monkeypatch.setattr(exercise, "world_sizes", (2,))
    verdicts = core.grade(REPO / "exercises" / "solutions" / "chapter11_sharding.py", 11)
    assert [v.status for v in verdicts] == ["ok"] * 4, "\n".join(v.line() for v in verdicts)


def test_a_correct_solution_built_differently_passes():
    """A heap for the owner map, broadcasts waited for together, torch._chunk_cat for the
    message, torch.chunk on meta tensors for the ledger: bit for bit the same."""
    verdicts = core.grade(REPO / "exercises" / "alternatives" / "ch11_chunk_cat.py", 11)
    assert [v.status for v in verdicts] == ["ok"] * 4, "\n".join(v.line() for v in verdicts)

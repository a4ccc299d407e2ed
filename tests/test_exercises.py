"""The graders: every solution passes, every stub is 'not implemented yet', every wrong solution
is rejected with the message that names its mistake, and a hang is ended with no rank left.

The graders run in this process (each grading launches its own ranks, gloo on CPU); the wrong
solutions that hang run with a shorter timeout (GRADER_TIMEOUT_S: 3 s on an idle machine), the
normal one being 15 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_scaled

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `exercises` is a top-level package, like `python -m` sees it

from exercises.grader import core  # noqa: E402
from exercises.grader.chapters import SLUGS, learner_file, solution_file  # noqa: E402

WRONG = REPO / "exercises" / "wrong"
CHAPTERS = sorted(SLUGS)
CHAPTER_IDS = [f"ch{c:02d}" for c in CHAPTERS]  # `-k ch09` selects one chapter's tests
pytestmark = pytest.mark.usefixtures("fork_server")  # grading ranks fork from conftest's server

# file in exercises/wrong/ -> {exercise: words its ✗ line must contain}
MISTAKES = {
    "ch01_drops_remainder": {"01.1": "pads by repeating", "01.2": "buffers count too"},
    "ch01_local_answer": {"01.1": "interleaves", "01.3": "the ranks disagree"},
    "ch01_checksum": {"01.2": "did not finish", "01.3": "checksum"},
    "ch02_src_zero": {"02.1": "src is not always 0", "02.2": "your own slot too"},
    "ch02_both_receive": {"02.2": "rank 0 was waiting in dist.recv from rank 1 (your line"},
    "ch02_keeps_own": {"02.3": "send input_list[r] to rank r"},
    "ch02_own_piece_missing": {"02.3": "own piece: add your own input_list[0] too"},
    "ch03_recv_first": {"03.2": "every rank receives before it sends"},
    "ch03_drops_remainder": {"03.2": "did you drop the remainder"},
    "ch03_no_allgather": {"03.2": "did you skip the all-gather phase"},
    "ch03_uses_all_reduce": {"03.2": "called dist.all_reduce (your line 9)",
                             "03.3": "take N - 1 steps"},
    "ch03_group_ranks": {"03.1": "and rank 1 is this rank itself. dist.send/recv take global "
                                 "ranks even with a group"},
    "ch03_reshape_copies": {"03.2": "the sum was never written back into the caller's tensor"},
    "ch04_guesses": {"04.1": "reverse of the definition order", "04.2": "reverse order"},
    "ch04_trap": {"04.1": "still has a hook", "04.3": "hands your hook the parameter"},
    "ch04_drops_last_bucket": {"04.2": "the last bucket, not full yet"},
    "ch05_no_divide": {"05.1": "did you divide by the world size?"},
    "ch05_no_broadcast": {"05.1": "make the replicas equal when DDP is constructed"},
    "ch05_ignores_no_sync": {"05.1": "no_sync must skip the communication",
                             "05.2": "communicated on 4 of 4 micro-batches"},
    "ch05_last_bucket": {"05.1": "never averaged", "05.2": "divide each micro-batch's loss"},
    "ch06_mean": {"06.1": "distance to the mean"},
    "ch06_local_count": {"06.1": "compares total compute times", "06.2": "own count"},
    "ch06_max": {"06.2": "that is the maximum"},
    "ch07_direct_write": {"07.1": "destroyed the previous checkpoint",
                          "07.3": "it has no .sha256 file yet"},
    "ch07_no_python_rng": {"07.1": "the folder holds", "07.2": "random.getstate()"},
    "ch07_no_rng": {"07.2": "no generator continued", "07.3": "Sort by the step number"},
    "ch09_no_divide": {"09.1": "2× torch's fp16 hook: did you divide by the world size?",
                       "09.2": "add the residual before the cast"},
    "ch09_returns_tensor": {"09.1": "returned a Tensor, not a torch.futures.Future",
                            "09.2": "the residual has the wrong sign"},
    "ch09_stays_fp16": {"09.1": "your Future holds torch.float16, the bucket is torch.float32",
                        "09.2": "the residual is torch.float16"},
    "ch09_no_write_back": {"09.1": "never went back into the bucket"},
    "ch09_divides_first": {"09.1": "you divided in float32 before the cast"},
    "ch11_smallest_first_flat_layout": {"11.1": "with the smallest parameters first",
                                        "11.3": "Lay the message out shard-major"},
    "ch11_round_robin_divides_first": {"11.1": "deals the parameters out in turn (round robin)",
                                       "11.3": "divided by 3 before the reduction"},
    "ch11_unsorted_unpadded_cut": {"11.1": "the greedy split in the model's order",
                                   "11.3": "cut back without the padding"},
    "ch11_no_broadcast_no_padding": {"11.2": "receive each parameter from its owner",
                                     "11.4": "counts the rows this rank really has"},
    "ch11_unsharded_state_padded_state": {"11.2": "self.optim holds all 8 parameters",
                                          "11.4": "That counts the padding rows"},
    "ch11_broadcast_from_zero_even_split": {"11.2": "not from rank 0",
                                            "11.4": "the paper's even split"},
    "ch11_broadcasts_own_only": {"11.2": "rank 1 was waiting in dist.broadcast (your line 22)"},
}
HANGS = {"ch01_checksum", "ch02_both_receive", "ch03_recv_first", "ch11_broadcasts_own_only"}


def hang_timeout() -> str:
    """GRADER_TIMEOUT_S for a wrong solution that hangs: long enough for its other exercises
    (forked ranks, well under a second each when idle), stretched by the machine's load."""
    return f"{load_scaled(3)[0]:.0f}"


def by_id(verdicts) -> dict:
    return {v.exercise.id: v for v in verdicts}


def assert_no_rank_left() -> None:
    alive = []
    for pid in core.LAUNCHED_PIDS:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        stat = Path(f"/proc/{pid}/stat")  # a zombie is dead, just not yet reaped (Linux)
        if not stat.exists() or stat.read_text().split()[2] != "Z":
            alive.append(pid)
    assert not alive, f"rank processes left running: {alive}"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=CHAPTER_IDS)
def test_solution_passes(chapter):
    verdicts = core.grade(solution_file(chapter), chapter)
    failed = [v.line() for v in verdicts if v.status != "ok"]
    assert not failed, "\n".join(failed)
    assert 2 <= len(verdicts) <= 4


@pytest.mark.parametrize(("name", "chapter"), [("ch03_ring_leftwards", 3),
                                               ("ch05_per_parameter", 5)])
def test_a_correct_solution_built_differently_passes(name, chapter):
    """Another ring direction and chunk cut (so another order of the float sum at 3 ranks), and
    a DDP with one message per parameter that divides after summing: both are right."""
    verdicts = core.grade(REPO / "exercises" / "alternatives" / f"{name}.py", chapter)
    failed = [v.line() for v in verdicts if v.status != "ok"]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("chapter", CHAPTERS, ids=CHAPTER_IDS)
def test_stub_is_not_implemented_yet(chapter):
    verdicts = core.grade(learner_file(chapter), chapter)
    assert [v.status for v in verdicts] == ["todo"] * len(verdicts), \
        "\n".join(v.line() for v in verdicts)
    source = learner_file(chapter).read_text()
    for v in verdicts:
        assert f'NotImplementedError("exercise {v.exercise.id}: ' in source


def test_at_least_18_exercises_and_3_wrong_solutions_per_chapter():
    from exercises.grader.chapters import load_chapter
    assert sum(len(load_chapter(c)) for c in CHAPTERS) >= 18
    for chapter in CHAPTERS:
        assert len(list(WRONG.glob(f"ch{chapter:02d}_*.py"))) >= 3, chapter
    assert set(MISTAKES) == {p.stem for p in WRONG.glob("ch*.py")}


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_wrong_solution_is_rejected_with_its_mistake(name, monkeypatch):
    if name in HANGS:
        monkeypatch.setenv("GRADER_TIMEOUT_S", hang_timeout())
    chapter = int(name[2:4])
    verdicts = by_id(core.grade(WRONG / f"{name}.py", chapter))
    for ex_id, words in MISTAKES[name].items():
        verdict = verdicts[ex_id]
        assert verdict.status in ("fail", "hang"), verdict.line()
        assert words in verdict.line(), verdict.line()
    assert_no_rank_left()


def test_a_hang_names_the_waiting_ranks_and_leaves_no_process(monkeypatch):
    timeout = hang_timeout()
    monkeypatch.setenv("GRADER_TIMEOUT_S", timeout)
    verdict = by_id(core.grade(WRONG / "ch03_recv_first.py", 3))["03.2"]
    assert verdict.status == "hang"
    assert f"did not finish within {timeout} s" in verdict.message
    assert "rank 0 was waiting in dist.recv from rank 1 (your line 15)" in verdict.message
    assert "rank 1 was waiting in dist.recv from rank 0 (your line 15)" in verdict.message
    assert_no_rank_left()


def run_grader(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exercises.grader", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli_stub_exits_nonzero_without_a_traceback():
    run = run_grader("06")
    assert run.returncode == 1
    assert run.stdout.count(": not implemented yet\n") == 2, run.stdout
    assert "Traceback" not in run.stdout + run.stderr


def test_cli_broken_files_get_one_clear_line(tmp_path):
    syntax = tmp_path / "syntax.py"
    syntax.write_text("import torch\n\ndef idle_per_rank(compute_ms)\n    pass\n")
    run = run_grader("06", str(syntax))
    assert run.returncode == 1
    assert "syntax error at your line 3" in run.stdout
    assert "Traceback" not in run.stdout + run.stderr
    raises = tmp_path / "raises.py"
    raises.write_text("def idle_per_rank(compute_ms):\n    return [1 / 0]\n")
    run = run_grader("06", str(raises), "--figures", str(tmp_path / "fig"))
    lines = run.stdout.splitlines()
    assert any("06.1" in line and "ZeroDivisionError at your line 2" in line for line in lines)
    assert any("06.2" in line and "your file has no `common_steps`" in line for line in lines)
    assert "Traceback" not in run.stdout + run.stderr


def test_cli_solution_passes_and_draws_the_feedback_figure(tmp_path):
    run = run_grader("03", "exercises/solutions/chapter03_ring_allreduce.py",
                     "--figures", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "exercise03_2.png").read_bytes().startswith(b"\x89PNG")

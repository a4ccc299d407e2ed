"""The grader against a learner file that misbehaves, and against the room it runs in.

Each case runs `python -m exercises.grader` the way `make grade-NN` does, in a sandbox (a fresh
TMPDIR, a marker in the environment of every process of the run), and asserts the exit code,
the last line, the verdict lines, that no process of the run is left (found by the marker), that
nothing is left in TMPDIR and that the output before the last line is intact.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO, load_scaled
from test_faults import Sandbox, last_line, wait_for

sys.path.insert(0, str(REPO))  # `exercises` is a top-level package, like `python -m` sees it
from exercises.grader import core
from exercises.grader.feedback import draw_figure

pytestmark = pytest.mark.usefixtures("fork_server")  # grading ranks fork from conftest's server

SOLUTION_06 = "from exercises.solutions.chapter06_bubbles import common_steps, idle_per_rank\n"
INTERRUPTED = {signal.SIGINT: (130, "error: interrupted (Ctrl-C); every rank was stopped"),
               signal.SIGTERM: (143, "error: stopped by SIGTERM; every rank was stopped")}


@pytest.fixture
def box(short_tmp_path):
    sandbox = Sandbox(short_tmp_path)
    sandbox.env.pop("GRADER_TIMEOUT_S", None)
    yield sandbox
    sandbox.kill_leftovers()


def learner(box: Sandbox, source: str, name: str = "mine.py") -> str:
    path = box.tmp.parent / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def grade(box: Sandbox, chapter: str, *args: str, timeout: float = 180, **env: str):
    box.env.update(env)
    return box.run("-m", "exercises.grader", chapter, *args, timeout=timeout)


# --- learner code that tries to end or outlive the grading ---------------------------------------

def test_a_module_level_exit_cannot_make_grading_pass(box):
    path = learner(box, SOLUTION_06 + "import os\nos._exit(0)\n")
    code, out, err = grade(box, "06", path)
    assert code == 1, out + err
    assert "your file ended the process that imported it (exit code 0)" in out
    assert "Well done" not in out
    assert out.splitlines()[-1].startswith("0 of 2 exercises pass")
    box.assert_clean()


def test_a_module_level_loop_is_stopped_and_named(box):
    path = learner(box, "import torch\n\nwhile True:\n    pass\n")
    # The import must reach the loop before the limit for its line to be named: on a busy
    # machine a forked process takes longer to get there, so the limit grows with the load.
    limit = round(load_scaled(3)[0])
    code, out, err = grade(box, "06", path, GRADER_TIMEOUT_S=str(limit))
    assert code == 1, out + err
    assert f"did not finish importing within {limit} s, still at your line 3" in out
    assert "Traceback" not in out + err
    box.assert_clean()


FORKS = SOLUTION_06.replace("common_steps,", "common_steps as solution,") + """
import os
import subprocess
import time


def common_steps(my_batches):
    subprocess.Popen(["sleep", "60"])
    if os.fork() == 0:  # a child in the rank's process group
        time.sleep(60)
        os._exit(0)
    if os.fork() == 0:  # a grandchild in a session of its own, its parent gone
        os.setsid()
        if os.fork() == 0:
            time.sleep(60)
        os._exit(0)
    return solution(my_batches)
"""


def test_processes_the_learner_started_do_not_survive_grading(box):
    proc = box.start("-m", "exercises.grader", "06", learner(box, FORKS))
    code = proc.wait(timeout=180)
    # Looked at as the grader exits, before its output is read: a survivor holds the pipe open.
    box.assert_clean()
    out, err = proc.communicate(timeout=30)
    assert code == 0, out + err  # the answers are right: it passes, and leaves nothing
    assert "2 of 2 exercises pass" in out


BUSY_03 = """
import os
import subprocess
from pathlib import Path


def naive_all_reduce(tensor, group=None):
    subprocess.Popen(["sleep", "60"])
    # Ranks fork from the grader's fork server, which keeps the environment it started with:
    # a test that grades in-process after another test started that server has no flag folder.
    if "GRADER_TEST_FLAGS" in os.environ:
        Path(os.environ["GRADER_TEST_FLAGS"], f"spinning-{os.getpid()}").touch()
    while True:
        pass


def ring_all_reduce(tensor, group=None):
    raise NotImplementedError("exercise 03.2")


def ring_time(n_bytes, world_size, alpha_s, beta_s_per_byte):
    raise NotImplementedError("exercise 03.3")
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_learner_code_spins_ends_everything(box, sig):
    flags = box.tmp.parent / "flags"
    flags.mkdir()
    box.env.update(GRADER_TEST_FLAGS=str(flags), GRADER_TIMEOUT_S="300")
    proc = box.start("-m", "exercises.grader", "03", learner(box, BUSY_03))
    wait_for(lambda: any(flags.iterdir()), proc, timeout=120)
    time.sleep(0.5)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    code, line = INTERRUPTED[sig]
    assert proc.returncode == code, err
    assert last_line(err) == line
    assert "Traceback" not in err
    assert out.startswith("Grading "), out
    box.assert_clean()


def test_ctrl_c_while_the_grader_starts_is_one_line(box):
    proc = box.start("-m", "exercises.grader", "05",
                     "exercises/solutions/chapter05_data_parallel.py")
    first = proc.stdout.readline()  # printed before torch is imported, the handlers in place
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert first.startswith("Grading "), first + err
    assert proc.returncode == 130, err
    assert last_line(err) == INTERRUPTED[signal.SIGINT][1]
    assert "Traceback" not in err
    box.assert_clean()


# --- what the grader is told -----------------------------------------------------------------

@pytest.mark.parametrize("value", ["abc", "nan", "0", "-1", "inf"])
def test_a_bad_grader_timeout_is_one_line_and_exit_2(box, value):
    code, _out, err = grade(box, "06", "exercises/solutions/chapter06_bubbles.py",
                            GRADER_TIMEOUT_S=value)
    assert code == 2
    assert last_line(err) == (f"error: GRADER_TIMEOUT_S must be a number of seconds greater "
                              f"than 0, got '{value}': unset it (`unset GRADER_TIMEOUT_S`) or "
                              "set e.g. 30")
    assert "Traceback" not in err
    box.assert_clean()


def test_a_file_that_is_not_python_is_named(box):
    notes = box.tmp.parent / "notes.txt"
    notes.write_text("def idle_per_rank(x):\n    return x\n")
    code, out, err = grade(box, "06", str(notes))
    assert code == 2
    assert last_line(err) == (f"error: {notes} is not a Python file: the grader imports your "
                              "code, so give the .py file you wrote the exercises in")
    assert "AttributeError" not in out + err
    box.assert_clean()


def test_make_grades_a_file_whose_name_has_a_space(box):
    path = learner(box, SOLUTION_06, name="my answers.py")
    # This interpreter, and its virtualenv taken as set up (-o: never remade here).
    proc = subprocess.run(["make", "-s", "VENV=.venv", "-o", ".venv/.installed", "grade-06",
                           f"FILE={path}", f"PY={sys.executable}"], cwd=REPO, env=box.env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Grading {path}" in proc.stdout
    assert "2 of 2 exercises pass" in proc.stdout
    box.assert_clean()


# --- hangs: the hint fits where the ranks were ----------------------------------------------

def test_a_busy_loop_is_not_blamed_on_a_collective(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADER_TEST_FLAGS", str(tmp_path))
    monkeypatch.setenv("GRADER_TIMEOUT_S", "4")
    path = tmp_path / "busy.py"
    path.write_text(BUSY_03)
    verdict = {v.exercise.id: v for v in core.grade(path, 3)}["03.1"]
    assert verdict.status == "hang", verdict.line()
    loop = BUSY_03.splitlines().index("    while True:") + 1
    assert f"rank 0 was running your line {loop} (`while True:`)" in verdict.message \
        or f"rank 0 was running your line {loop + 1} (`pass`)" in verdict.message, verdict.message
    assert "waited for no message: your code itself did not return" in verdict.message
    assert "receives before it sends" not in verdict.message


# --- messages that name the actual mistake ---------------------------------------------------

def test_reduce_scatter_without_its_own_piece_is_not_told_about_an_all_gather():
    wrong = REPO / "exercises" / "wrong" / "ch02_own_piece_missing.py"
    line = {v.exercise.id: v for v in core.grade(wrong, 2)}["02.3"].line()
    assert "without rank 0's own piece: add your own input_list[0] too" in line, line
    assert "all-gather" not in line and "chunk" not in line, line


def test_a_long_feedback_title_fits_in_the_figure():
    title = ("gradient difference per parameter, step 2 (bucket_cap_mb=0.000123, "
             "gradient_as_bucket_view=False, find_unused_parameters=True)")
    fig = draw_figure("05.1", {"figure": "bars", "labels": ["0.weight", "0.bias"],
                               "values": [1e-9, 2e-9], "ylabel": "max |yours - native|",
                               "title": title})
    fig.canvas.draw()
    box = fig.axes[0].title.get_window_extent(fig.canvas.get_renderer())
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (box, fig.bbox)
    assert box.y1 <= fig.bbox.height, (box, fig.bbox)


# --- a learner's grading leaves the repository as it was ---------------------------------------

def _tracked_state() -> tuple[str, dict]:
    status = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout
    figures = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
               for p in (REPO / "exercises" / "feedback").glob("*.png")}
    return status, figures


def test_grading_leaves_git_status_as_it_was(box):
    before = _tracked_state()
    code, out, err = grade(box, "03", "exercises/solutions/chapter03_ring_allreduce.py")
    assert code == 0, out + err
    assert "  feedback figure: out/feedback/exercise03_2.png" in out.splitlines()
    assert _tracked_state() == before
    box.assert_clean()


def test_a_temporary_directory_too_long_for_the_fork_servers_socket_still_grades(box):
    """The fork server's Unix socket lives in TMPDIR; past the socket path limit the grader
    spawns its ranks instead (it raised "AF_UNIX path too long" before)."""
    deep = box.tmp / ("t" * max(1, 90 - len(str(box.tmp))))
    deep.mkdir()
    code, out, err = grade(box, "06", learner(box, SOLUTION_06), TMPDIR=str(deep))
    assert code == 0, out + err
    assert out.splitlines()[-1].startswith("2 of 2 exercises pass"), out
    deep.rmdir()  # empty: the ranks left nothing in it
    box.assert_clean()


def test_refresh_reference_grades_the_solution_only(box, tmp_path):
    code, out, err = grade(box, "03", "mine.py", "--refresh-reference")
    assert code == 2
    assert last_line(err).endswith("--refresh-reference grades the reference solution: give "
                                   "no FILE")
    code, out, err = grade(box, "03", "--refresh-reference", "--figures", str(tmp_path / "ref"))
    assert code == 0, out + err
    assert out.startswith("Grading exercises/solutions/chapter03_ring_allreduce.py")
    assert (tmp_path / "ref" / "exercise03_2.png").read_bytes().startswith(b"\x89PNG")
    box.assert_clean()

"""The suite's own cheaper launch (conftest.launch_forked): ranks forked from a fork server that
has imported torch, and a session that used it leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
from conftest import REPO, launch_forked, load_scaled
from test_chapter08 import group_members

import ddplab


def parent_pid(ctx, args) -> int:
    return os.getppid()


def test_forked_ranks_come_from_the_fork_server_not_from_this_process(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = ddplab.parse_chapter_args(ddplab.chapter_parser("test"),
                                         ["--world-size", "2", "--out", str(tmp_path)])
    assert launch_forked(parent_pid, args).result != os.getpid()


def test_a_session_that_forked_ranks_leaves_no_process_behind():
    # The test above, in a session of its own (its own process group): the fork server and
    # every rank it forked must be gone soon after that session's pytest exits.
    bound, load = load_scaled(120)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             __file__, "-k", "come_from_the_fork_server"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the session took over {bound:.0f} s (load {load:.1f})", pytrace=False)
    assert proc.returncode == 0, out[-3000:]
    assert "1 passed" in out, out[-3000:]
    deadline = time.monotonic() + 10  # the server notices its parent's exit by a closed pipe
    while (left := group_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], f"left by the session: {left}"

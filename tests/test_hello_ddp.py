"""Hello, DDP (scripts/hello_ddp.py), the script readers copy: it trains under both launchers.

Each run starts in a session of its own, so that after it returns the test can ask whether any
process of that session (a rank, a torchrun agent) is still alive.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO
from torch import nn

SCRIPT = "scripts/hello_ddp.py"
LAUNCHERS = {
    "python": [sys.executable, SCRIPT],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2", SCRIPT],
}


def session_alive(pgid: int, settle_s: float = 0.0) -> bool:
    """Is a process of group ``pgid`` still running after ``settle_s``?  (A zombie, dead but
    not yet reaped by init, does not count.)  The settle is for multiprocessing's resource
    tracker: it exits once its launcher has, when it reads the end of its pipe, which on a
    busy machine can take a moment."""
    deadline = time.monotonic() + settle_s
    while _group_running(pgid):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.1)
    return False


def _group_running(pgid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited while we looked
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            return True
    return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_hello_ddp_trains_saves_and_leaves_nothing_running(launcher, tmp_path):
    checkpoint = tmp_path / "hello.pt"
    proc = subprocess.Popen([*LAUNCHERS[launcher], str(checkpoint)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
        left_running = session_alive(proc.pid, settle_s=5.0)  # looked at before the clean-up
    finally:
        if session_alive(proc.pid):
            os.killpg(proc.pid, 9)
    assert proc.returncode == 0, stderr[-3000:]
    assert not left_running, "a rank or launcher process outlived the run"

    losses = [float(v) for v in re.findall(r"epoch \d+: mean loss ([0-9.]+)", stdout)]
    assert len(losses) == 5, stdout  # rank 0 alone prints, once per epoch
    assert losses[-1] < losses[0] / 10, f"the loss did not drop: {losses}"

    assert checkpoint.is_file() and f"saved {checkpoint}" in stdout
    state = torch.load(checkpoint, weights_only=True)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    model.load_state_dict(state)  # saved from model.module: no "module." prefix in the keys
    assert all(torch.isfinite(t).all() for t in state.values())


# One rank trains in a fresh interpreter and counts its threads: after main()'s finally, the
# group's threads (gloo's workers and its socket loop) must be gone.  If torch.distributed.nn
# were first imported by DDP, after init_process_group, its functions' default argument
# group=group.WORLD would keep the group alive and its threads with it, into Python's shutdown.
ONE_RANK_COUNTS_ITS_THREADS = """
import os, sys
sys.path.insert(0, "scripts")
import hello_ddp
import torch
threads = lambda: len(os.listdir("/proc/self/task"))
torch.randn(512, 512) @ torch.randn(512, 512)  # starts torch's own pool of compute threads
before = threads()
hello_ddp.main(sys.argv[1])
print("threads", before, threads())
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
def test_leaving_the_group_ends_its_threads(tmp_path):
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    run = subprocess.run([sys.executable, "-c", ONE_RANK_COUNTS_ITS_THREADS,
                          str(tmp_path / "one.pt")], cwd=REPO, env=env, text=True,
                         capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    before, after = map(int, re.search(r"threads (\d+) (\d+)", run.stdout).groups())
    assert after == before, f"{after - before} thread(s) of the group outlived it"

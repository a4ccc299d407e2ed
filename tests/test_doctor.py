"""`make doctor`: the pre-flight check, with simulated failures (a taken port, a missing package,
a full disk, a broken gloo, a slow collective, a rendezvous that never forms, no temporary
directory) and one real run.  Its total time is a benchmark (`tools/bench.py --doctor`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import doctor
import pytest
from conftest import load_scaled

from ddplab.run.node_guard import descendants

REPO = Path(__file__).resolve().parents[1]


def test_a_taken_port_is_reported_with_the_fix():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        check = doctor.check_port(s.getsockname()[1])
    assert check.mark == doctor.WARN
    assert "is taken" in check.detail and "--master-port" in check.fix
    assert doctor.check_port(doctor.free_port()).mark == doctor.OK


def test_a_missing_package_blocks_the_day(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "PACKAGES", {**doctor.PACKAGES, "no_such_module_x": "no-such-pkg"})
    assert doctor.main(["--no-site"]) == 1
    out = capsys.readouterr().out
    assert "✗ packages" in out and "missing: no-such-pkg" in out and "make setup" in out
    assert "error: packages would block the workshop day" in out


def test_a_full_disk_and_a_broken_gloo_are_failures(monkeypatch):
    assert doctor.check_disk(REPO, need_gb=1e9).mark == doctor.FAIL
    monkeypatch.setattr(doctor, "all_reduce_works",
                        lambda *a, **k: doctor.AllReduceRun(False, "Connection refused"))
    check = doctor.check_gloo()
    assert check.mark == doctor.FAIL and "GLOO_SOCKET_IFNAME" in check.fix


def test_a_rank_that_never_answers_is_killed(monkeypatch):
    monkeypatch.setattr(doctor, "ALL_REDUCE", "import time\ntime.sleep(60)\n")
    before = set(descendants(os.getpid()))  # what earlier tests of this session left running
    run = doctor.all_reduce_works(2, "gloo", timeout=2)
    assert not run.ok and "no answer within 2 s" in run.detail
    assert not set(descendants(os.getpid())) - before  # no rank of this check left behind


# --- busy or network: measured, not guessed --------------------------------------------------

@pytest.mark.slow
def test_a_slow_collective_is_a_busy_machine_not_the_network():
    # the ranks connect, then each waits far longer than the check's time before its all-reduce;
    # the check's time need only cover two ranks' start (a few seconds), scaled by the load
    timeout, _ = load_scaled(6)
    check = doctor.check_gloo(timeout=timeout, delay_s=600)
    assert check.mark == doctor.WARN, check
    assert check.detail.startswith(f"busy — rerun: no answer within {timeout:.0f} s: the ranks "
                                   "connected but the all-reduce was slow"), check.detail
    assert "GLOO_SOCKET_IFNAME" not in check.fix and "rerun" in check.fix


@pytest.mark.slow
def test_a_rendezvous_that_never_forms_is_the_network(monkeypatch):
    # no rank hosts the rendezvous: every rank's connection is refused until it gives up.
    # torch's TCPStore client tries twice, pausing a few seconds between: with the doctor's 8 s
    # each, about 20 s; 2 s each shows the same
    monkeypatch.setattr(doctor, "STORE_TIMEOUT_S", 2.0)
    check = doctor.check_gloo(timeout=60, unreachable=True)
    assert check.mark == doctor.FAIL, check
    assert "busy" not in check.detail and "connect" in check.detail, check.detail
    assert "GLOO_SOCKET_IFNAME" in check.fix


@pytest.mark.parametrize(("phases", "load", "busy", "says"), [
    (["started", "imported"], 0.1, True, "still importing torch"),  # CPU work, not network
    (["joined", "joined"], 0.1, True, "the ranks connected but the all-reduce was slow"),
    (["imported", "connected"], 0.1, False, "the ranks never connected"),  # idle: the network
    (["imported", "connected"], 9.0, True, "the ranks never connected"),  # loaded: cannot tell
])
def test_a_run_out_of_time_is_judged_by_where_the_ranks_were(monkeypatch, phases, load, busy,
                                                             says):
    monkeypatch.setattr(doctor, "machine_load", lambda: (load, 2))
    run = doctor.no_answer_verdict(phases, timeout=20)
    assert (run.ok, run.busy) == (False, busy)
    assert says in run.detail and f"load {load:.1f} on 2 cores" in run.detail


# --- bad input and a machine without a temporary directory ----------------------------------

@pytest.mark.parametrize("port", ["70000", "0", "-1", "http"])
def test_a_bad_port_is_one_line_and_exit_2(port):
    run = subprocess.run([sys.executable, "tools/doctor.py", "--port", port], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"doctor.py: error: argument --port: {port!r} is not a port (1 to 65535) (see --help)"]


def test_no_writable_temp_dir_is_a_failed_row_not_a_traceback(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))  # what tempfile will use
    assert doctor.main(["--no-site"]) == 1
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if "temp dir" in line]
    assert row and row[0].startswith(" ✗ temp dir") and "none writable" in row[0], out
    assert "export TMPDIR" in out and "Traceback" not in out
    assert out.strip().splitlines()[-1].startswith("error: temp dir")


@pytest.mark.slow
def test_doctor_passes_on_this_machine():
    run = subprocess.run([sys.executable, "tools/doctor.py", "--no-site"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "✓ gloo all-reduce" in run.stdout and "Ready for the workshop." in run.stdout

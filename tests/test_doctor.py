"""`make doctor`: the pre-flight check, with simulated failures (a taken port, a missing package,
a full disk, a broken gloo) and one real run."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import doctor
import pytest

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
    monkeypatch.setattr(doctor, "all_reduce_works", lambda *a, **k: (False, "Connection refused"))
    check = doctor.check_gloo()
    assert check.mark == doctor.FAIL and "GLOO_SOCKET_IFNAME" in check.fix


def test_a_rank_that_never_answers_is_killed(monkeypatch):
    monkeypatch.setattr(doctor, "ALL_REDUCE", "import time\ntime.sleep(60)\n")
    ok, why = doctor.all_reduce_works(2, "gloo", timeout=2)
    assert not ok and "no answer within 2 s" in why


@pytest.mark.slow
def test_doctor_passes_on_this_machine():
    run = subprocess.run([sys.executable, "scripts/doctor.py", "--no-site"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "✓ gloo all-reduce" in run.stdout and "Ready for the workshop." in run.stdout

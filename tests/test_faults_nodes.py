"""Chapter 10's emulated nodes on every exit path: a launcher killed with SIGKILL, SIGTERM and
Ctrl-C at well-defined points, and what a killed run leaves (found and removed by the next run
or `make doctor`).  Each run's processes are found by its marker (``ddpl-<launcher pid>``, in
every command line of the run) or by namespace, never by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import doctor
import pytest
from conftest import REPO
from test_faults import _sigint_as_in_a_terminal, last_line

from ddplab.run import netns

SCRIPT = "scripts/chapter10_many_nodes.py"
NEEDS_ROOT = pytest.mark.skipif(netns.unavailable_reason() is not None,
                                reason=f"{netns.unavailable_reason()}")


def _ip(*argv: str) -> str:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=10).stdout


def processes_marked(marker: str, also: str = "") -> list[str]:
    """Live processes whose command line carries ``marker`` (and ``also``); zombies are dead."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if (marker.encode() in cmdline and also.encode() in cmdline
                    and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"):
                found.append(f"process {proc.name}: {cmdline[:200]!r}")
        except OSError:
            pass
    return found


def left_by(pid: int, tmp: Path | None = None) -> list[str]:
    """Everything of the run whose launcher was ``pid`` still on the machine: namespaces (the
    tbf qdiscs live on their veth ends), veth ends, processes, scratch and torchrun's dirs."""
    tag = f"ddpl-{pid}"
    found = [n for n in _ip("netns", "list").split() if n.startswith(f"{tag}-")]
    found += [ln for ln in _ip("-o", "link").splitlines() if f" {tag}a" in ln or f" {tag}b" in ln]
    found += processes_marked(tag)
    found += [str(p) for p in Path("/tmp").glob(f"torchelastic_*/{tag}_*")]
    if tmp is not None:  # torch's compiler cache is meant to outlive runs: not ours
        found += [str(p) for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]
    return found


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(0.2)


def gone(pid: int, tmp: Path | None = None, timeout: float = 20) -> list[str]:
    """What the run of ``pid`` still leaves after ``timeout`` (processes take a moment)."""
    deadline = time.monotonic() + timeout
    while left_by(pid, tmp) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left_by(pid, tmp)


# --- what a killed run leaves, and who removes it (no torch: fast) ------------------------------

# A launcher in miniature: two nodes with a shaped cable and a process in each, then it waits.
MINI_LAUNCHER = f"""
import subprocess, sys, time
sys.path.insert(0, {str(REPO / "scripts" / "ddplab" / "run")!r})
import netns
pair = netns.TwoNodes.create()
pair.set_rate(100.0)
for node in pair.nodes:
    subprocess.Popen(node.command(["sleep", "600"]))
while len(pair.pids()) < 4:  # a guard and its sleep in each node
    time.sleep(0.1)
print("ready", flush=True)
time.sleep(600)
"""


def start_mini_launcher() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", MINI_LAUNCHER], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@NEEDS_ROOT
def test_a_killed_launchers_node_processes_end_and_doctor_removes_the_rest():
    launcher = start_mini_launcher()
    namespaces = [f"ddpl-{launcher.pid}-{n}" for n in "ab"]
    try:
        launcher.kill()
        launcher.wait()
        # the processes inside the nodes die with their launcher ...
        wait_until(lambda: not any(_ip("netns", "pids", ns).split() for ns in namespaces),
                   timeout=15, what="the end of every process inside the killed run's nodes")
        # ... the namespaces (cable, qdisc) stay until someone removes them
        assert set(namespaces) <= set(_ip("netns", "list").split())
        assert "tbf" in subprocess.run(["tc", "-n", namespaces[0], "qdisc", "show"],
                                       capture_output=True, text=True, timeout=10).stdout
        check = doctor.check_leftovers()
        assert check.mark == doctor.WARN, check
        assert check.detail.startswith("removed what an earlier two-node run left when it was "
                                       "killed: "), check.detail
        assert all(f"namespace {ns}" in check.detail for ns in namespaces), check.detail
        assert not left_by(launcher.pid)
    finally:
        launcher.kill()
        netns.remove_leftovers()


# The next chapter 10 run removes what a killed one left, and says so: chapter 10's own quick
# run checks it (tests/test_chapter10.py, killed_run).


@NEEDS_ROOT
def test_only_what_a_dead_run_made_is_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    mine = f"ddpl-{os.getpid()}-ch10-live"  # this test's process runs: a live run's directory
    for name in (f"ddpl-{dead.pid}-ch10-x1", mine, "ddpl-ch10-someone", "ddplab-123"):
        (tmp_path / name).mkdir()
    with netns.TwoNodes.create() as live:  # named after this (live) process
        removed = netns.remove_leftovers(str(tmp_path))
        assert all(live.exists().values())
    assert removed == [f"directory {tmp_path / f'ddpl-{dead.pid}-ch10-x1'}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [mine, "ddpl-ch10-someone", "ddplab-123"])


# --- chapter 10 itself --------------------------------------------------------------------------

def start_chapter10(tmp_path: Path, *argv: str) -> tuple[subprocess.Popen, Path]:
    """Chapter 10 --quick with a TMPDIR of its own (everything it leaves is visible there),
    and Ctrl-C acting as in a terminal even when the test runner ignores it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, SCRIPT, "--quick", "--timeout", "60", *argv,
                             "--out", str(tmp_path / "out")], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)},
                            preexec_fn=_sigint_as_in_a_terminal)
    return proc, tmp


def scratch_dir(pid: int, tmp: Path) -> Path | None:
    found = list(tmp.glob(f"ddpl-{pid}-ch10-*"))
    return found[0] if found else None


def node_ranks_up(pid: int) -> bool:
    """The 4 ranks of both nodes started (they carry the run's scratch dir, hence its marker)."""
    return len(processes_marked(f"ddpl-{pid}", also="--node-worker")) >= 4


@NEEDS_ROOT
@pytest.mark.slow
def test_sigkill_of_chapter10_ends_its_ranks_and_the_next_doctor_removes_the_rest(tmp_path):
    proc, tmp = start_chapter10(tmp_path, "--no-failover")
    try:
        wait_until(lambda: node_ranks_up(proc.pid) or proc.poll() is not None, timeout=240,
                   what="the two nodes' ranks")
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        proc.kill()
        proc.wait()
        wait_until(lambda: not processes_marked(f"ddpl-{proc.pid}"), timeout=20,
                   what="the end of torchrun and its ranks in both nodes")
        doc = subprocess.run([sys.executable, "tools/doctor.py", "--no-site"], cwd=REPO,
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "TMPDIR": str(tmp)})
        row = [ln for ln in doc.stdout.splitlines() if ln.startswith(" ! leftovers")]
        assert row and f"namespace ddpl-{proc.pid}-a" in row[0], doc.stdout
        assert f"directory {tmp / 'ddpl-'}{proc.pid}-ch10-" in row[0], doc.stdout
        assert not gone(proc.pid, tmp), gone(proc.pid, tmp)
    finally:
        proc.kill()
        netns.remove_leftovers(str(tmp))


@NEEDS_ROOT
@pytest.mark.slow
def test_sigterm_during_the_failover_reference_run_is_reported_and_leaves_nothing(tmp_path):
    proc, tmp = start_chapter10(tmp_path, "--failover")

    def reference_ranks_up() -> bool:  # chapter 07's run has made its temporary directory
        scratch = scratch_dir(proc.pid, tmp)
        return bool(scratch and list(scratch.glob("tmp-reference/ddplab-*")))

    try:
        wait_until(lambda: reference_ranks_up() or proc.poll() is not None, timeout=300,
                   what="the failover's reference run")
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-2000:]
    assert last_line(err) == "error: stopped by SIGTERM; every rank was stopped"
    assert not gone(proc.pid, tmp), gone(proc.pid, tmp)


def _in_phase(phase: str):
    def reached(pid: int, tmp: Path) -> bool:
        scratch = scratch_dir(pid, tmp)
        return bool(scratch and (scratch / phase).exists())
    return reached


# Points of the two-node run, each observable from outside: its scratch directory exists (the
# namespaces are being built), the ranks of both nodes run, the first phase is being measured.
POINTS = {
    "namespaces": lambda pid, tmp: scratch_dir(pid, tmp) is not None,
    "ranks": lambda pid, tmp: node_ranks_up(pid),
    "measuring": _in_phase("go-unshaped"),
}


@NEEDS_ROOT
@pytest.mark.slow
@pytest.mark.parametrize(("sig", "point"), [
    pytest.param(signal.SIGINT, p, id=f"SIGINT-{p}") for p in POINTS
] + [pytest.param(signal.SIGTERM, "ranks", id="SIGTERM-ranks")])
def test_a_signal_at_each_point_of_the_two_node_run_stops_it(tmp_path, sig, point):
    proc, tmp = start_chapter10(tmp_path, "--no-failover")
    try:
        wait_until(lambda: POINTS[point](proc.pid, tmp) or proc.poll() is not None,
                   timeout=240, what=f"the point {point!r}")
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    expected = {signal.SIGINT: (130, "error: interrupted (Ctrl-C); every rank was stopped"),
                signal.SIGTERM: (143, "error: stopped by SIGTERM; every rank was stopped")}
    assert (proc.returncode, last_line(err)) == expected[sig], err[-2000:]
    assert not gone(proc.pid, tmp), gone(proc.pid, tmp)

"""The fault suite: what a user does wrong, or what goes wrong under them, and what they see.

Each scenario asserts the exit code, that the last line names the cause, that no process of the
run is left (found by a marker in the environment every process of the run inherits, never by
name), that nothing is left in the temporary directory (TMPDIR points at a fresh one per test),
and that no earlier output or checkpoint is lost.  Most run ``tests/fault_entry.py``, a small
chapter-like script on the shared launcher; the checkpoint scenarios run in this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, refuse_in_process
from torch import nn

from ddplab import checkpoint as ck
from ddplab import checkpoint_dcp as dcpck

ENTRY = str(REPO / "tests" / "fault_entry.py")
CH01, CH05, CH07 = (f"scripts/{name}.py" for name in (
    "chapter01_processes", "chapter05_data_parallel", "chapter07_checkpointing"))


class Sandbox:
    """A fresh TMPDIR and --out for one run, and a marker that every process of it inherits."""

    def __init__(self, root: Path):
        self.tmp, self.out = root / "tmp", root / "out"
        self.tmp.mkdir()
        self.out.mkdir()
        self.marker = uuid.uuid4().hex
        self.env = {**os.environ, "TMPDIR": str(self.tmp), "DDPLAB_FAULT_RUN": self.marker}

    def start(self, *argv: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, *argv], cwd=REPO, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, preexec_fn=_sigint_as_in_a_terminal)

    def run(self, *argv: str, timeout: float = 120) -> tuple[int, str, str]:
        proc = self.start(*argv)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_leftovers()
            raise
        return proc.returncode, out, err

    def refuse(self, *argv: str) -> tuple[int, str, str]:
        """``run`` for input that must be refused before any process starts, in this process
        (conftest's ``refuse_in_process``, which fails if a rank starts), this sandbox's TMPDIR
        its temporary directory."""
        saved, tempfile.tempdir = tempfile.tempdir, str(self.tmp)
        try:
            code, err = refuse_in_process(*argv)
        finally:
            tempfile.tempdir = saved
        return code, "", err

    def processes(self) -> list[int]:
        """Live processes whose environment carries this sandbox's marker."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if f"DDPLAB_FAULT_RUN={self.marker}".encode() in environ and state != "Z":
                found.append(int(entry))
        return found

    def kill_leftovers(self) -> None:
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def assert_clean(self, settle_s: float = 2.0) -> None:
        """No process of the run left (the resource tracker may take a moment to see EOF),
        and nothing left in TMPDIR."""
        deadline = time.monotonic() + settle_s
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self.processes()
        self.kill_leftovers()
        assert not left, f"processes of the run still running: {left}"
        # torch's compiler cache (torchinductor_<user>) is meant to outlive runs: not ours
        left = sorted(p.name for p in self.tmp.iterdir() if not p.name.startswith("torchinductor_"))
        assert left == [], "files left in TMPDIR"


def _sigint_as_in_a_terminal() -> None:
    """A test runner started in the background ignores SIGINT, and its children inherit that
    (and Python then installs no Ctrl-C handler): give the run the default, as a shell does."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def box(short_tmp_path):
    sandbox = Sandbox(short_tmp_path)
    yield sandbox
    sandbox.kill_leftovers()


def last_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    return lines[-1] if lines else ""


def wait_for(condition, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.2)


# --- stopping a run from outside ----------------------------------------------------------------

@pytest.mark.parametrize(("sig", "to_group", "code", "message"), [
    (signal.SIGINT, False, 130, "error: interrupted (Ctrl-C); every rank was stopped"),
    (signal.SIGINT, True, 130, "error: interrupted (Ctrl-C); every rank was stopped"),
    (signal.SIGTERM, False, 143, "error: stopped by SIGTERM; every rank was stopped"),
])
def test_a_signal_stops_every_rank_at_once_and_has_the_last_word(box, sig, to_group, code,
                                                                   message):
    proc = box.start(ENTRY, "spin", "--out", str(box.out))
    wait_for(lambda: (box.out / "rank1.pid").exists(), proc)
    if to_group:  # Ctrl-C in a terminal: every process of the foreground group gets it
        os.killpg(proc.pid, sig)
    else:  # only the launching process, as `kill PID` does
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert last_line(err) == message
    box.assert_clean()  # the ranks were stopped before the launching process ended


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def children_of(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):
            if parent_of(int(entry)) == pid:
                found.append(int(entry))
    return found


def test_ranks_forked_by_the_fork_server_die_with_a_sigkilled_script(box):
    """A script's CPU ranks are forked by multiprocessing's fork server, which outlives the
    script as long as a rank holds its pipe: each rank watches the script instead."""
    proc = box.start(ENTRY, "spin", "--out", str(box.out))
    wait_for(lambda: (box.out / "rank1.pid").exists(), proc)
    ranks = [int((box.out / f"rank{r}.pid").read_text()) for r in (0, 1)]
    assert {parent_of(pid) for pid in ranks} - {proc.pid}, "the ranks were not forked"
    proc.kill()
    proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while box.processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = box.processes()
    box.kill_leftovers()
    proc.communicate(timeout=60)  # the ranks held its pipes
    assert left == [], "the ranks, the fork server or the resource tracker outlived the script"


HELD_BLOCK = """
import os, signal, sys, threading, time
from ddplab.run import stopping
stopping.stop_on_sigterm()
threading.Thread(target=threading.Event().wait, daemon=True).start()  # does not block signals
try:
    with stopping.stops_held():
        os.kill(os.getpid(), int(sys.argv[1]))  # blocked here: the kernel gives it the thread
        time.sleep(0.5)  # Python runs a handler in the main thread between two bytecodes
        print("the block ran to its end", flush=True)
except BaseException as err:
    print(type(err).__name__, flush=True)
"""


@pytest.mark.parametrize(("sig", "raised"), [(signal.SIGINT, "KeyboardInterrupt"),
                                             (signal.SIGTERM, "Stopped")])
def test_a_stop_that_another_thread_receives_still_waits_for_the_held_block(sig, raised):
    """Ranks start inside ``stops_held``: a stop that cut the start short would leave the ranks
    started so far unknown and running (a chapter 08 run hung so, its ranks waiting for a peer)."""
    out = subprocess.run([sys.executable, "-c", HELD_BLOCK, str(int(sig))], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO / "scripts")},
                         capture_output=True, text=True, timeout=60,
                         preexec_fn=_sigint_as_in_a_terminal)
    assert out.stdout.splitlines() == ["the block ran to its end", raised], out.stderr


PROBE_INTERRUPTED = """
import os, signal, sys, tempfile, time
from {module} import find_tempdir
{handlers}
def probe():  # tempfile's search for its directory, with a Ctrl-C between write and remove
    probe_file = os.path.join(os.environ["TMPDIR"], "abcd1234")
    open(probe_file, "w").close()
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.3)  # a handler would run here, between two bytecodes
    os.remove(probe_file)
    print("the probe ran to its end", flush=True)
    return os.environ["TMPDIR"]
tempfile._get_default_tempdir = probe
try:
    find_tempdir()
except BaseException as err:
    print(type(err).__name__, flush=True)
"""


@pytest.mark.parametrize(("module", "handlers", "raised"), [
    ("ddplab.run.stopping", "", "KeyboardInterrupt"),  # what run_main turns into one line
    ("exercises.grader.__main__", "from exercises.grader.__main__ import main, _stop_on_signal\n"
     "signal.signal(signal.SIGINT, _stop_on_signal)", "Stopped")])
def test_a_ctrl_c_while_tempfile_finds_its_directory_leaves_no_probe_file(
        tmp_path, module, handlers, raised):
    """tempfile finds TMPDIR once, by writing a file with an 8-letter name there and removing
    it: a grader interrupted in between leaves that file behind.  Both entry points (run_main,
    the grader) find it first with the stops held."""
    code = PROBE_INTERRUPTED.format(module=module, handlers=handlers)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": f"{REPO / 'scripts'}:{REPO}",
                              "TMPDIR": str(tmp_path)},
                         timeout=60, preexec_fn=_sigint_as_in_a_terminal)
    assert out.stdout.splitlines() == ["the probe ran to its end", raised], out.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stopping_chapter07_during_its_torchrun_demo_ends_torchrun_and_its_ranks(box, sig):
    proc = box.start(ENTRY, "restart", "--quick", "--out", str(box.out), "--timeout", "30")

    def ranks_up() -> bool:
        logs = list(box.tmp.glob("ddplab-ch07-*/restart/log.jsonl"))
        return bool(logs) and '"boot"' in logs[0].read_text()

    wait_for(ranks_up, proc, timeout=120)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (130 if sig == signal.SIGINT else 143), err
    assert "every rank was stopped" in last_line(err)
    box.assert_clean()  # torchrun, both its ranks, the work directory, torchrun's own files


# --- a rank that fails --------------------------------------------------------------------------

def test_a_killed_rank_is_named_last_after_the_resource_trackers_warnings(box):
    code, _, err = box.run(ENTRY, "kill", "--out", str(box.out))
    assert code == 1
    assert last_line(err) == ("error: rank 1 failed: the process was killed by SIGKILL (no "
                              "Python traceback: killed, out of memory, or a crash in native "
                              "code)")
    box.assert_clean()


def test_a_rank_that_raises_leaves_no_error_file_behind(box):
    code, _, err = box.run(ENTRY, "raise", "--out", str(box.out), "--timeout", "30")
    assert code == 1
    assert last_line(err) == "error: rank 1 failed: ValueError: rank 1 broke on purpose"
    box.assert_clean()  # mp.spawn's pytorch-errorfile-*.pickle is gone too


def test_a_frozen_rank_ends_the_run_soon_after_the_timeout(box):
    # Rank 1 stops itself (SIGSTOP): it ignores SIGTERM until continued.  mp.spawn's own join
    # waits 30 s before SIGKILL; ours SIGKILLs after 2 x 2 s.  The 25 s limit, counted once the
    # ranks are up, is not a speed measurement: it only tells those two apart (--timeout 2 + 4 s
    # against --timeout 2 + 30 s).
    proc = box.start(ENTRY, "freeze", "--out", str(box.out), "--timeout", "2")
    wait_for(lambda: (box.out / "rank1.pid").exists(), proc)
    try:
        _, err = proc.communicate(timeout=25)
    except subprocess.TimeoutExpired:
        box.kill_leftovers()
        raise
    assert proc.returncode == 1
    assert "did not arrive within --timeout" in last_line(err)
    box.assert_clean()


def test_a_taken_port_does_not_matter(box):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        box.env["MASTER_PORT"] = str(held.getsockname()[1])
        code, _, err = box.run(ENTRY, "outputs", "--out", str(box.out))
    assert code == 0, err
    box.assert_clean()


# --- bad input: one line, exit 2, before any rank starts --------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    ([ENTRY, "outputs", "--timeout", "nan"], "--timeout must be a finite number, got nan"),
    ([ENTRY, "outputs", "--timeout", "inf"], "--timeout must be a finite number, got inf"),
    ([ENTRY, "outputs", "--timeout", "1e300"], "--timeout 1e+300 is more than a week"),
    ([CH05, "--bucket-cap-mb", "nan"], "argument --bucket-cap-mb: must be a finite number"),
    ([CH01, "--crash-rank", "5", "--world-size", "2"], "--crash-rank 5: this run has ranks 0..1"),
    ([CH07, "--train", "--ckpt-dir", "CKPT", "--quick", "--crash-at-step", "1000"],
     "--crash-at-step 1000: the run has 48 steps (--quick), choose 0..47"),
])
def test_bad_flags_are_one_line_and_exit_2(box, argv, message):
    argv = [str(box.out / "ckpt") if a == "CKPT" else a for a in argv]
    code, _, err = box.refuse(*argv, "--out", str(box.out / "figures"))
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert message in err
    assert not list(box.out.glob("figures/chapter*")) and not (box.out / "ckpt").exists()
    box.assert_clean()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_nccl_without_a_gpu_is_one_line(box):
    code, _, err = box.refuse(ENTRY, "outputs", "--backend", "nccl", "--out", str(box.out))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert last_line(err).startswith("error: --backend nccl") and "gloo" in last_line(err)
    box.assert_clean()


# --- outputs: checked before the run, written as one set ---------------------------------------

@pytest.mark.parametrize("blocker", ["chapter99", "chapter99/results.json"])
def test_an_unusable_output_place_is_refused_before_the_run(box, blocker):
    if blocker.endswith(".json"):
        (box.out / blocker).mkdir(parents=True)
    else:
        (box.out / blocker).write_text("mine")
    code, _, err = box.run(ENTRY, "outputs", "--out", str(box.out))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{box.out / blocker} is a" in err
    assert not (box.out / "rank0.pid").exists(), "the check must come before the run"
    box.assert_clean()


def test_a_run_replaces_the_whole_set_of_figures(box):
    assert box.run(ENTRY, "outputs", "--draw", "a.png,b.png", "--out", str(box.out))[0] == 0
    code, _, err = box.run(ENTRY, "outputs", "--draw", "a.png", "--out", str(box.out))
    assert code == 0, err
    assert sorted(p.name for p in (box.out / "chapter99").iterdir()) == ["a.png",
                                                                         "results.json"]
    assert not [p for p in box.out.iterdir() if p.name.startswith(".")]  # no staging left
    box.assert_clean()


def test_concurrent_runs_into_one_directory_leave_one_complete_set(box):
    procs = [box.start(ENTRY, "outputs", "--draw", f"{name}.png", "--out", str(box.out))
             for name in ("x", "y")]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    names = sorted(p.name for p in (box.out / "chapter99").iterdir())
    assert names in (["results.json", "x.png"], ["results.json", "y.png"])
    json.loads((box.out / "chapter99" / "results.json").read_text())
    assert not [p for p in box.out.iterdir() if p.name.startswith(".")]
    box.assert_clean()


# --- checkpoints: every damage is one clear line, the previous checkpoint is never lost ------

def state(value: float) -> dict:
    return {"model": {"w": torch.full((256,), float(value))}, "step": int(value)}


@pytest.fixture
def saved(tmp_path):
    ck.save_checkpoint(state(1), tmp_path, 1)
    return ck.save_checkpoint(state(2), tmp_path, 2).path


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: p.write_bytes(p.read_bytes()[:100]), "is truncated or corrupted (100 bytes"),
    (lambda p: p.write_bytes(b""), "is truncated or corrupted (0 bytes"),
    (lambda p: ck.checksum_path(p).write_text(""), "step_0000002.pt.sha256 is empty"),
    (lambda p: ck.checksum_path(p).unlink(), "never completely written"),
])
def test_a_damaged_checkpoint_is_one_clear_line(saved, damage, message):
    damage(saved)
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(saved)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert ck.load_checkpoint(saved.with_name("step_0000001.pt"))["step"] == 1  # not lost


def test_random_bytes_with_a_matching_checksum_are_not_blamed_on_weights_only(saved):
    saved.write_bytes(os.urandom(4096))
    ck.checksum_path(saved).write_text(f"{ck._sha256(saved)}  {saved.name}\n")
    with pytest.raises(ck.CheckpointError, match=r"is not a torch\.save file") as err:
        ck.load_checkpoint(saved)
    assert "weights_only" not in str(err.value)


def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(tmp_path):
    code = ("import resource, signal, sys, torch; from ddplab import checkpoint as ck; "
            "ck.save_checkpoint({'w': torch.ones(10)}, sys.argv[1], 1); "
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)); "
            "ck.save_checkpoint({'w': torch.zeros(100_000)}, sys.argv[1], 2)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO / "scripts")},
                          timeout=120)
    assert proc.returncode == 1
    assert last_line(proc.stderr).endswith("cannot write "
                                           f"{tmp_path / 'step_0000002.pt'}: File too large; "
                                           "free some space or checkpoint somewhere else (the "
                                           "previous checkpoint is intact)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000001.pt",
                                                          "step_0000001.pt.sha256"]
    assert ck.load_checkpoint(ck.latest_checkpoint(tmp_path))["w"].eq(1).all()


def test_resuming_with_other_settings_is_refused_by_name():
    saved = {"seed": 0, "world_size": 2, "config": {"hidden": 256}}
    ck.check_same_run(saved, dict(saved), Path("c.pt"))
    with pytest.raises(ck.CheckpointError, match=r"c\.pt was saved by a run with seed=0, this "
                                                  r"run has seed=1"):
        ck.check_same_run(saved, {**saved, "seed": 1}, Path("c.pt"))
    with pytest.raises(ck.CheckpointError, match="config="):
        ck.check_same_run(saved, {**saved, "config": {"hidden": 512}}, Path("c.pt"))


@pytest.mark.slow
def test_chapter07_refuses_to_resume_with_another_seed(box):
    ckpt = box.out / "ckpt"
    train = [CH07, "--train", "--quick", "--ckpt-dir", str(ckpt), "--out", str(box.out / "f")]
    code, _, err = box.run(*train, "--seed", "0", timeout=180)
    assert code == 0, err
    before = sorted(p.name for p in (ckpt / "torch").iterdir())
    code, _, err = box.run(*train, "--seed", "1", timeout=180)
    assert code == 1
    assert "was saved by a run with seed=0, this run has seed=1" in last_line(err)
    assert sorted(p.name for p in (ckpt / "torch").iterdir()) == before  # nothing lost
    box.assert_clean()


# --- DCP checkpoints: the same integrity guarantee -----------------------------------------------

@pytest.fixture
def dcp_saved(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (1, 2):
        dcpck.save_distributed(tmp_path / "dcp", step, model, optimizer, {"step": step})
    yield tmp_path / "dcp" / "step_0000002", model, optimizer
    dist.destroy_process_group()


def _shard(path: Path) -> Path:
    return next(path.glob("*.distcp"))


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: _flip_a_byte(_shard(p)), "is truncated or corrupted"),
    (lambda p: _shard(p).write_bytes(_shard(p).read_bytes()[:50]), "(50 bytes"),
    (lambda p: _shard(p).unlink(), "is missing (listed in checksums.sha256)"),
    (lambda p: (p / "checksums.sha256").write_text(""), "checksums.sha256 is empty"),
])
def test_a_damaged_dcp_checkpoint_is_one_clear_line(dcp_saved, damage, message):
    path, model, optimizer = dcp_saved
    shard = _shard(path).name
    damage(path)
    with pytest.raises(ck.CheckpointError) as err:
        dcpck.load_distributed(path, model, optimizer, {"step": 0})
    assert message in str(err.value) and "\n" not in str(err.value)
    if "checksums" not in message:
        assert shard in str(err.value)  # names the file
    previous = path.with_name("step_0000001")
    assert dcpck.load_distributed(previous, model, optimizer, {"step": 0}) == {"step": 1}


def test_a_dcp_error_inside_torch_is_one_clear_line_not_a_checkpoint_exception(dcp_saved):
    path, model, optimizer = dcp_saved
    with pytest.raises(ck.CheckpointError, match=r"cannot be loaded \(rank 0: ") as err:
        dcpck.load_distributed(path, model, optimizer, {"step": 0, "not_saved": 1})
    assert "\n" not in str(err.value)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


"""The fault suite, bad input and full disks: what a user gives wrong, or what runs out under them.

The conventions of tests/test_faults.py: each scenario asserts the exit code, the exact last line
(naming the file, key, flag or variable), that no process of the run is left (found by the
marker every process of the run inherits, never by name), that nothing is left in TMPDIR, and
that earlier output is intact.
"""

# ruff: noqa: F811  (test_faults' fixtures, imported, are the arguments of these tests)
from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import REPO
from test_faults import (  # noqa: F401  (box, saved, dcp_saved: fixtures)
    CH01,
    CH07,
    ENTRY,
    Sandbox,
    box,
    children_of,
    dcp_saved,
    last_line,
    saved,
    wait_for,
)
from test_replot import CHAPTERS, committed_run, no_rank_may_start

from backstage.chapter07_report import LOCK_NAME, locked_directory
from ddplab import checkpoint as ck
from ddplab.run.cli import UsageError

CH05, CH06, CH08 = (f"scripts/{name}.py" for name in (
    "chapter05_data_parallel", "chapter06_bubbles", "chapter08_bug_lab"))
FAULTS = "chapter99_faults.py"  # fault_entry's name for itself
INTERRUPTED = "error: interrupted (Ctrl-C); every rank was stopped"
TERMINATED = "error: stopped by SIGTERM; every rank was stopped"
AGAIN = "(edited by hand? run the chapter again to rewrite it)"
NO_ROOM = ("No space left on device; free some space there, or write elsewhere (--out DIR, "
           "--ckpt-dir DIR, TMPDIR=DIR)")


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# --- one checkpoint directory, one run --------------------------------------------------------

@pytest.mark.slow
def test_a_second_run_on_a_checkpoint_directory_in_use_is_refused(box):
    ckpt = box.out / "ckpt"
    train = [CH07, "--train", "--quick", "--ckpt-dir", str(ckpt)]
    first = box.start(*train, "--seed", "0", "--out", str(box.out / "a"))
    lock = ckpt / LOCK_NAME
    wait_for(lambda: lock.is_file() and f"PID {first.pid} " in lock.read_text(), first)
    code, _, err = box.run(*train, "--seed", "1", "--out", str(box.out / "b"))
    assert code == 2
    line = one_line(err)
    assert line.startswith(f"error: --ckpt-dir {ckpt} is in use by the run with PID {first.pid} "
                           f"on {socket.gethostname()} since "), line
    assert line.endswith(": wait until that run ends, or choose another --ckpt-dir")
    assert not (box.out / "b").exists() or not any((box.out / "b").iterdir())
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=60)
    assert first.returncode == 143 and last_line(err) == TERMINATED
    assert not (ckpt / "final.pt").exists()  # neither run claims to have finished
    box.assert_clean()
    with locked_directory(ckpt):  # the lock went with its run
        pass


def test_a_lock_left_by_a_killed_run_does_not_block(box):
    ckpt = box.out / "ckpt"
    hold = ("import sys, time; sys.path.insert(0, 'scripts'); from pathlib import Path; "
            "from backstage.chapter07_report import locked_directory\n"
            "with locked_directory(Path(sys.argv[1])):\n"
            "    print('held', flush=True); time.sleep(600)")
    holder = box.start("-c", hold, str(ckpt))
    assert holder.stdout.readline().strip() == "held"
    with (pytest.raises(UsageError, match=rf"is in use by the run with PID {holder.pid} on "),
          locked_directory(ckpt)):
        pass
    holder.kill()  # SIGKILL: no cleanup; the file stays, the lock does not
    holder.communicate(timeout=60)
    assert (ckpt / LOCK_NAME).is_file()
    with locked_directory(ckpt):
        assert f"PID {os.getpid()} " in (ckpt / LOCK_NAME).read_text()
    box.assert_clean()


# --- flags and environment: one line, exit 2, before any rank -------------------------------

@pytest.mark.parametrize(("argv", "line"), [
    ([ENTRY, "outputs", "--timeout", "1e-9"],
     f"{FAULTS}: error: --timeout 1e-09 is too short: the ranks need about 1 s just to meet; "
     "use --timeout 1 or more"),
    ([ENTRY, "outputs", "--seed", str(10**23)],
     f"{FAULTS}: error: --seed must be between 0 and 4294967295 (numpy's limit), got {10**23}"),
    ([CH06, "--delays", "0,nan"],
     "error: --delays '0,nan': need at least two delays, each a number of ms from 0 up to "
     "below --timeout (120000 ms)"),
    ([CH06, "--delays", "0,inf"],
     "error: --delays '0,inf': need at least two delays, each a number of ms from 0 up to "
     "below --timeout (120000 ms)"),
    ([CH07, "--train", "--ckpt-dir", "FILE"],
     "error: --ckpt-dir FILE names a file: checkpoints need a directory; choose another "
     "--ckpt-dir"),
])
def test_bad_flags_are_refused_at_parse_time(box, argv, line):
    file = box.out / "a-file"
    file.write_text("mine")
    argv = [str(file) if a == "FILE" else a for a in argv]
    code, _, err = box.refuse(*argv, "--out", str(box.out / "figures"))
    assert code == 2
    assert one_line(err) == line.replace("FILE", str(file))
    assert file.read_text() == "mine" and not list(box.out.glob("figures/chapter*"))
    box.assert_clean()


def test_more_ranks_than_the_memory_holds_are_refused(box):
    code, _, err = box.run(CH01, "--world-size", "100000", "--out", str(box.out))
    assert code == 2
    assert re.fullmatch(r"chapter01_processes\.py: error: --world-size 100000 needs about "
                        r"22000000 MiB \(about 220 MiB per rank\) but \d+ MiB are available "
                        r"\(MemAvailable in /proc/meminfo\): use --world-size \d+ or fewer",
                        one_line(err)), err
    box.assert_clean()


STALE = "RANK/WORLD_SIZE are set but not by torchrun (no TORCHELASTIC_RUN_ID, no " \
        "MASTER_ADDR/MASTER_PORT): unset them (unset RANK WORLD_SIZE LOCAL_RANK) or run under " \
        "torchrun"


@pytest.mark.parametrize(("variables", "message"), [
    ({"WORLD_SIZE": "junk"},
     "WORLD_SIZE='junk' in the environment is not a whole number: unset it, or run under "
     "torchrun, which sets it"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 in the environment: a world needs at least 1 rank"),
    ({"RANK": "2"}, "RANK=2 in the environment: WORLD_SIZE=2 has ranks 0..1"),
    ({}, STALE),  # a trio left in the shell: it would wait the whole --timeout for its peers
])
def test_junk_or_stale_torchrun_variables_are_one_line(box, variables, message):
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK",
                 "LOCAL_WORLD_SIZE"):
        box.env.pop(name, None)
    box.env.update({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", **variables})
    code, _, err = box.run(ENTRY, "outputs", "--out", str(box.out), timeout=60)
    assert code == 2
    assert one_line(err) == f"{FAULTS}: error: {message}"
    assert not (box.out / "rank0.pid").exists()
    box.assert_clean()


# --- checksum files that are not text --------------------------------------------------------

def test_a_non_utf8_checksum_file_is_named(saved):
    record = ck.checksum_path(saved)
    record.write_bytes(b"\xff" + record.read_bytes())
    with pytest.raises(ck.CheckpointError) as err:
        ck.load_checkpoint(saved)
    assert str(err.value) == (f"{record} is damaged (byte 0 is not text, so it is not a SHA-256 "
                              f"record): delete it and {saved.name} to resume from the "
                              "previous checkpoint")
    assert ck.load_checkpoint(saved.with_name("step_0000001.pt"))["step"] == 1  # not lost


def test_a_non_utf8_dcp_manifest_is_named(dcp_saved):
    from ddplab import checkpoint_dcp as dcpck

    path, model, optimizer = dcp_saved
    manifest = path / "checksums.sha256"
    manifest.write_bytes(manifest.read_bytes()[:10] + b"\x80")
    with pytest.raises(ck.CheckpointError) as err:
        dcpck.load_distributed(path, model, optimizer, {"step": 0})
    assert str(err.value) == (f"{manifest} is damaged (byte 10 is not text, so it is not a "
                              f"SHA-256 record): delete {path} to resume from the previous "
                              "checkpoint")
    previous = path.with_name("step_0000001")
    assert dcpck.load_distributed(previous, model, optimizer, {"step": 0}) == {"step": 1}


# --- stopped half-way: nothing left behind ---------------------------------------------------

def test_ctrl_c_during_a_checkpoint_save_leaves_no_temporary_file(box):
    proc = box.start(ENTRY, "save", "--out", str(box.out))
    wait_for(lambda: (box.out / "saving").exists(), proc)
    ckpt = box.out / "ckpt"
    assert list(ckpt.glob(".step_0000001.pt.sha256.tmp-*")), "the save is not half-way"
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert last_line(err) == INTERRUPTED
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_0000001.pt"]  # no commit record:
    box.assert_clean()  # it counts as never written


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code", "line"), [(signal.SIGINT, 130, INTERRUPTED),
                                                   (signal.SIGTERM, 143, TERMINATED)])
def test_stopping_chapter08_leaves_no_scratch_directory(box, sig, code, line):
    proc = box.start(CH08, "--quick", "--out", str(box.out))
    wait_for(lambda: any(box.tmp.glob("buglab-*")), proc, timeout=120)
    (os.killpg if sig == signal.SIGINT else os.kill)(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert last_line(err) == line
    box.assert_clean()  # buglab-* went with the run


def _sigint_held_off(pid: int) -> bool:
    """SIGINT is blocked or ignored in ``pid``: a Ctrl-C cannot interrupt it (whether the
    traceback then shows depends on a race with the launcher's SIGTERM)."""
    status = dict(line.split(":\t", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    bit = 1 << (signal.SIGINT - 1)
    return bool((int(status["SigBlk"], 16) | int(status["SigIgn"], 16)) & bit)


def _is_fork_server(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
    return False


# Who imports torch after the script started its ranks: the fork server (CPU ranks on Linux),
# or each rank (spawned: what a TMPDIR too long for the server's socket gets, and a GPU).
IMPORTERS_UP = {"fork server": lambda children: any(map(_is_fork_server, children)),
                "spawned ranks": lambda children: len(children) >= 3}  # and the tracker


@pytest.mark.parametrize("importer", IMPORTERS_UP)
def test_ctrl_c_while_torch_is_imported_for_the_ranks_prints_no_traceback(short_tmp_path,
                                                                          importer):
    root = short_tmp_path / ("a-long-tmpdir-" * 6 if importer == "spawned ranks" else "box")
    root.mkdir()
    box = Sandbox(root)
    try:
        proc = box.start(ENTRY, "spin", "--out", str(box.out))
        wait_for(lambda: IMPORTERS_UP[importer](children_of(proc.pid)), proc)
        assert all(_sigint_held_off(child) for child in children_of(proc.pid))
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert last_line(err) == INTERRUPTED
        assert not (box.out / "rank0.pid").exists(), "the ranks were already up: too late to tell"
        box.assert_clean()
    finally:
        box.kill_leftovers()


# --- a full disk ------------------------------------------------------------------------------

@contextlib.contextmanager
def tiny_filesystem(path: Path, size: str):
    """A tmpfs of ``size`` mounted on ``path`` (needs root), unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir(exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_full_out_directory_is_one_line(box):
    with tiny_filesystem(box.out / "full", "64k") as out:
        folder = out / "chapter01"
        folder.mkdir()
        for name in ("results.json", "replicas.json"):
            (folder / name).write_bytes((REPO / "figures" / "chapter01" / name).read_bytes())
        before = {p.name: p.read_bytes() for p in folder.iterdir()}
        code, _, err = box.run(CH01, "--replot", "--out", str(out))
        assert code == 1, err
        assert last_line(err) == f"error: cannot write {folder}: {NO_ROOM}"
        assert {n: (folder / n).read_bytes() for n in before} == before  # inputs intact
        box.assert_clean()


def test_a_full_tmpdir_is_one_line_not_an_eoferror(box):
    # A rank's result (8 MB) does not fit, and then neither does its error report: mp.spawn
    # found an empty report and raised EOFError in the launching process.
    with tiny_filesystem(box.tmp, "256k"):
        code, _, err = box.run(ENTRY, "big", "--out", str(box.out))
        assert code == 1, err
        assert re.fullmatch(rf"error: cannot write {re.escape(str(box.tmp))}/ddplab-\w+: "
                            f"{re.escape(NO_ROOM)}", last_line(err)), err
        assert "EOFError" not in err
        box.assert_clean()


# --- --replot on a hand-edited results.json ---------------------------------------------------

def _schema(chapter: int) -> dict:
    return importlib.import_module(f"drawing.chapter{chapter:02d}").SCHEMA


def _set(results: dict, key: str, value) -> None:
    *parents, last = key.split(".")
    for part in parents:
        results = results[part]
    if value is _DELETE:
        del results[last]
    else:
        results[last] = value


_DELETE = object()
_KIND = {"dict": "a dict", "list": "a list", "str": "a string", "number": "a number"}


def _cases():
    for chapter in sorted(CHAPTERS):
        schema = _schema(chapter)
        top = next(iter(schema))
        nested = [k for k in schema if "*" not in k and "." in k] or [top]
        yield pytest.param(chapter, top, _DELETE, f'key "{top}" is missing',
                           id=f"ch{chapter:02d}-deleted-{top}")
        key = nested[-1]
        junk, got = (5, "got the number 5") if schema[key] == "str" else ("x", "got a string")
        yield pytest.param(chapter, key, junk, f'key "{key}" should be {_KIND[schema[key]]}, {got}',
                           id=f"ch{chapter:02d}-wrong-type-{key}")


@pytest.mark.parametrize(("chapter", "key", "value", "message"), list(_cases()))
def test_replot_names_the_file_and_the_key(chapter, key, value, message, tmp_path, monkeypatch):
    folder, _ = committed_run(tmp_path, chapter)
    path = folder / "results.json"
    results = json.loads(path.read_text())
    _set(results, key, value)
    path.write_text(json.dumps(results))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    no_rank_may_start(monkeypatch)
    script = importlib.import_module(CHAPTERS[chapter])
    with pytest.raises(UsageError) as err:
        script.main(["--replot", "--out", str(tmp_path)])
    assert str(err.value) == f"{path}: {message} {AGAIN}"
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # nothing drawn


def _replace_step_time(text: str) -> str:
    return re.sub(r'("step_time_ms": \{[^}]*"native": )[-0-9.e]+', r"\1NaN", text, count=1)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda text: "[]", "holds a list, not the chapter's results"),
    (lambda text: "null", "holds null, not the chapter's results"),
    (_replace_step_time, 'key "step_time_ms.native" is nan, not a number'),
    (lambda text: "\udcff" + text, "byte 0 is not UTF-8 text"),
])
def test_replot_of_a_broken_results_json_is_one_line(box, edit, message):
    folder, _ = committed_run(box.out, 5)
    path = folder / "results.json"
    path.write_bytes(edit(path.read_text()).encode("utf-8", "surrogateescape"))
    code, _, err = box.run(CH05, "--replot", "--out", str(box.out))
    assert code == 2
    assert one_line(err) == f"error: {path}: {message} {AGAIN}"
    assert not list(folder.glob("*.png"))
    box.assert_clean()


def test_replot_of_a_truncated_side_file_names_it(box):
    folder, _ = committed_run(box.out, 1)
    side = folder / "replicas.json"
    side.write_bytes(side.read_bytes()[:100])
    code, _, err = box.run(CH01, "--replot", "--out", str(box.out))
    assert code == 2
    line = one_line(err)
    assert line.startswith(f"error: {side} is not valid JSON (") and line.endswith(
        f"; cut short? {AGAIN[1:]}"), line
    box.assert_clean()


def test_replot_names_the_folder_when_the_drawing_cannot_use_a_value(box):
    folder, _ = committed_run(box.out, 1)
    path = folder / "results.json"
    results = json.loads(path.read_text())
    results["ranks"] = [{"what": "not a rank"}]  # right kind, wrong content: past the schema
    path.write_text(json.dumps(results))
    code, _, err = box.run(CH01, "--replot", "--out", str(box.out))
    assert code == 2
    assert re.fullmatch(rf"error: {re.escape(str(folder))}: cannot draw from these files "
                        rf"\(\w+: .*; edited by hand\? run the chapter again to rewrite it\)",
                        one_line(err)), err
    box.assert_clean()


# --- the test suite on a busy machine ---------------------------------------------------------

def test_a_run_bound_grows_with_the_load_and_a_timeout_says_so(monkeypatch):
    import conftest

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (7.0, 7.0, 7.0))
    assert conftest.load_scaled(100) == (400.0, 7.0)  # (7 + 1) / 2 cores: four times slower
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert conftest.load_scaled(100) == (100.0, 0.0)  # an idle machine: the bound as given
    with pytest.raises(pytest.fail.Exception) as failed:
        conftest.run_script("-c", "import time; time.sleep(30)", timeout=1)
    assert str(failed.value) == ("python -c import time; time.sleep(30) timed out after 1 s; "
                                 "load average was 0.0 on 2 cores when it started (1 s on an "
                                 "idle machine, scaled by the load)")

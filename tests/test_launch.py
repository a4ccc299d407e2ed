"""ddplab.launch: world sizes, ports, failures, timeouts, backends, bad input."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import rank_workers
from conftest import REPO, refuse_in_process, run_script

import ddplab
from ddplab.run import cli, launch
from ddplab.run.first_failure import Claim

CH01 = "scripts/chapter01_processes.py"


def parse(*argv: str, out: Path):
    return ddplab.parse_chapter_args(ddplab.chapter_parser("test"), [*argv, "--out", str(out)])


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_rank_runs_and_rank0_result_comes_back(world_size, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 3 ranks on a 2-core machine warns, on purpose
        args = parse("--world-size", str(world_size), out=tmp_path)
    run = ddplab.launch(rank_workers.report_ranks, args)

    assert run.result["everyone"] == [(r, world_size, r) for r in range(world_size)]
    assert run.result["sum"] == world_size * (world_size - 1) / 2
    assert run.result["pg_is_world"]
    assert run.result["threads"] >= 1
    assert run.provenance["world_size"] == world_size
    assert run.provenance["launcher"] == "mp.spawn"
    assert run.provenance["backend"] == "gloo"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_a_cpu_rank_uses_the_cores_it_may_run_on_not_the_machines(tmp_path):
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # as in a container or a Slurm job with one core
    try:  # the spawned rank inherits the affinity
        run = ddplab.launch(rank_workers.report_ranks, parse("--world-size", "1", out=tmp_path))
    finally:
        os.sched_setaffinity(0, allowed)
    assert run.result["threads"] == 1


def test_same_seed_gives_the_same_random_numbers_on_every_rank(tmp_path):
    run = ddplab.launch(rank_workers.random_draw, parse("--seed", "7", out=tmp_path))
    assert run.result[0] == run.result[1]


def test_a_taken_port_does_not_matter(tmp_path, monkeypatch):
    # Hold the port every tutorial hard-codes, and point MASTER_PORT at it: spawn mode asks the
    # OS for a free port instead, so the run still works.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        monkeypatch.setenv("MASTER_PORT", str(held.getsockname()[1]))
        run = ddplab.launch(rank_workers.report_ranks, parse(out=tmp_path))
    assert run.result["sum"] == 1


def test_two_runs_at_once_do_not_collide(tmp_path):
    cmd = [sys.executable, CH01, "--quick"]
    procs = [subprocess.Popen([*cmd, "--out", str(tmp_path / str(i))], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err


def test_a_rank_that_raises_ends_the_run_and_is_named(tmp_path):
    with pytest.raises(ddplab.RankFailed) as failure:
        ddplab.launch(rank_workers.rank1_raises, parse("--timeout", "30", out=tmp_path))
    assert failure.value.rank == 1
    assert str(failure.value) == "rank 1 failed: ValueError: rank 1 broke on purpose"
    assert "rank_workers.py" in failure.value.details  # the failing rank's own traceback


def test_a_crash_in_the_teardown_after_the_work_is_done_does_not_fail_the_run(tmp_path):
    # A rank that has handed over its result ends at once, without the interpreter's teardown.
    run = ddplab.launch(rank_workers.teardown_aborts, parse(out=tmp_path))
    assert run.result == 2


def test_a_rank_waits_for_the_threads_its_worker_left_running(tmp_path):
    ddplab.launch(rank_workers.leaves_a_writer_thread, parse(out=tmp_path))
    assert sorted(p.name for p in tmp_path.glob("written-by-*")) == [
        "written-by-rank0.txt", "written-by-rank1.txt"]


def test_a_rank_stuck_in_a_collective_times_out(tmp_path):
    with pytest.raises(ddplab.RankFailed) as failure:
        ddplab.launch(rank_workers.rank1_never_arrives, parse("--timeout", "3", out=tmp_path))
    assert not (tmp_path / "rank1-woke-up").exists()  # stopped, not waited for (no clock)
    assert failure.value.rank == 0  # rank 0 gave up waiting; rank 1 was stopped


GLOO_TIMEOUT = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                            "30000ms for recv operation to complete")
CLOSED = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.21.0.1]")


@pytest.mark.parametrize(("error", "first", "reported"), [
    (GLOO_TIMEOUT, Claim(1, follow_on=True), "Timed out"),  # rank 1 only heard of it
    (CLOSED, Claim(1, follow_on=True), None),  # both heard of something else
    (ValueError("bad checkpoint"), Claim(1, follow_on=False), None),  # one cause, twice
])
def test_under_torchrun_a_rank_that_lost_the_claim_reports_a_cause_the_first_did_not_have(
        error, first, reported, tmp_path, monkeypatch, capsys):
    # rank 0's timeout closed its sockets, and rank 1's "closed by peer" claimed first
    def run_rank(worker, args, *, on_error, **_):
        on_error(error, first)
        raise error

    monkeypatch.setattr(launch, "_run_rank", run_rank)
    monkeypatch.setattr(launch, "_FOLLOW_ON_GRACE_S", 0.0)
    args = parse("--timeout", "30", out=tmp_path)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    if reported:  # its own error, not "rank 1 failed first"
        with pytest.raises(ddplab.RankFailed, match=reported):
            launch._launched_by_torchrun(rank_workers.report_ranks, args)
        assert "failed first" not in capsys.readouterr().err
    else:  # one line naming the rank that claimed, then exit 1: one traceback in the log
        with pytest.raises(SystemExit):
            launch._launched_by_torchrun(rank_workers.report_ranks, args)
        assert "[rank 0] stopped: rank 1 failed first" in capsys.readouterr().err


def test_crash_from_the_command_line_prints_one_traceback_and_one_last_line(out_dir):
    run = run_script(CH01, "--crash-rank", "1", "--out", str(out_dir), "--timeout", "30")
    assert run.returncode == 1
    last_line = run.stderr.strip().splitlines()[-1]
    assert last_line == ("error: rank 1 failed: RuntimeError: rank 1 crashed on purpose "
                         "(--crash-rank 1)")
    assert run.stderr.count("Traceback (most recent call last)") == 1
    assert not (out_dir / "chapter01").exists(), "a failed run must not write results"


def test_nccl_without_gpus_is_one_clear_line(out_dir):
    code, err = refuse_in_process(CH01, "--backend", "nccl", "--out", str(out_dir))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: --backend nccl")
    assert "gloo" in lines[0]  # says what to do instead


@pytest.mark.parametrize(("argv", "message"), [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--world-size", "0"], "--world-size must be at least 1"),
    (["--backend", "mpi"], "invalid choice: 'mpi'"),
    (["--timeout", "0"], "--timeout must be positive"),
])
def test_bad_flags_are_one_line_and_exit_2(argv, message, out_dir):
    code, err = refuse_in_process(CH01, *argv, "--out", str(out_dir))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert message in lines[0]
    assert not out_dir.exists()


def test_a_refusal_checked_in_this_process_fails_if_the_ranks_start(out_dir):
    # refuse_in_process (conftest) guards the in-process checks of bad input above: good flags
    # get as far as starting ranks, which it must report instead of running them here
    with pytest.raises(AssertionError, match="started ranks instead of refusing"):
        refuse_in_process(CH01, "--out", str(out_dir))


def test_unwritable_out_is_one_line_and_writes_nothing(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code, err = refuse_in_process(CH01, "--out", str(blocker / "figures"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "cannot write to --out" in lines[0]
    assert blocker.read_text() == "not a directory"


def test_more_ranks_than_cores_is_allowed_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 2)
    with pytest.warns(UserWarning, match="3 ranks on 2 CPU cores"):
        args = parse("--world-size", "3", out=tmp_path)
    assert args.world_size == 3


def test_placement_on_this_machine():
    assert ddplab.place("auto", "gloo", 4).backend == "gloo"
    if not _enough_gpus(2):
        assert ddplab.place("auto", "auto", 2).backend == "gloo"
        with pytest.raises(ddplab.UsageError, match=r"^--backend nccl"):
            ddplab.place("auto", "nccl", 2)


def test_get_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown key"):
        ddplab.get("world")


def _enough_gpus(n: int) -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= n

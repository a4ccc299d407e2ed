"""Chapter 07 end to end: one --quick run (mp.spawn, with its torchrun restart inside)."""

from __future__ import annotations

import pytest
from conftest import PROVENANCE_KEYS, assert_png, load_results, run_quick, run_script

import ddplab

SCRIPT = "scripts/chapter07_checkpointing.py"
ISSUE_KEYS = {"resume", "dcp", "restart", "save_ms", "load_ms", "checkpoint_mb",
              "corrupt_file_error"}


@pytest.fixture(scope="module")
def chapter(tmp_path_factory):
    return run_quick(tmp_path_factory, SCRIPT, 7)


@pytest.mark.slow
def test_quick_run_writes_everything(chapter):
    run, out, results = chapter
    for name in ("resume.png", "restart.png", "cost.png"):
        assert_png(out / "chapter07" / name)
    assert results.keys() >= ISSUE_KEYS
    assert results["provenance"].keys() >= PROVENANCE_KEYS
    assert results["provenance"]["quick"] is True
    assert "restart  max |Δparam| vs uninterrupted = 0" in run.stdout


@pytest.mark.slow
def test_every_resume_is_bit_for_bit(chapter):
    # 2 ranks on gloo: a + b is exact in any order, so nothing may differ at all.
    _, _, results = chapter
    for key in ("resume", "dcp", "restart"):
        assert results[key]["max_abs_diff"] == 0.0, key
        assert results[key]["resumed_from_step"] == 40  # the last checkpoint before step 45
    assert results["resume"]["crash_error"] == (
        "rank 1 failed: RuntimeError: rank 1 crashed on purpose at step 45")
    assert results["uninterrupted"]["replica_diff"] == 0.0


@pytest.mark.slow
def test_torchrun_really_restarted_the_group(chapter):
    _, _, results = chapter
    restart = results["restart"]
    assert restart["restarts"] == 1  # TORCHELASTIC_RESTART_COUNT of the attempt that finished
    assert restart["attempts"] == [0, 1]
    assert restart["lost_steps"] == restart["crashed_at_step"] - restart["resumed_from_step"] == 5
    assert any("exitcode: -9" in line for line in restart["torchrun_said"])
    assert any("will restart worker group" in line for line in restart["torchrun_said"])


@pytest.mark.slow
def test_costs_and_bad_input_messages(chapter):
    _, _, results = chapter
    assert results["save_ms"] > 0 and results["load_ms"] > 0 and results["checkpoint_mb"] > 0
    assert min(results["dcp"]["mb_per_rank"]) > 0  # DCP spreads the writing
    bad = results["bad_input"]
    assert results["corrupt_file_error"] == bad["corrupted"]
    assert "truncated or corrupted" in bad["corrupted"] and "\n" not in bad["corrupted"]
    assert "never completely written" in bad["incomplete"]
    assert "does not exist" in bad["missing_dir"]
    assert "different model" in bad["wrong_shape"]
    assert bad["torch_load_alone_changed_weight_by"] > 0  # why the checksum is there
    atomic = results["atomic"]
    assert atomic["exit_code"] == -9 and atomic["latest"] == "step_0000001.pt"
    assert atomic["latest_loads"] and any(".tmp-" in f for f in atomic["files"])


@pytest.mark.slow
def test_pitfalls_show_their_real_errors_and_differences(chapter):
    _, _, results = chapter
    pitfalls = results["pitfalls"]
    assert pitfalls["every_rank_saves"]["error"]  # rank 0 read a half-written file
    for rank in pitfalls["no_map_location"]["ranks"]:
        assert "CUDA" in rank["without"] and rank["with"] == "cpu"  # a CPU-only machine
    assert pitfalls["no_map_location"]["saved_on"] == ["cuda:0"]
    assert "model.module.state_dict()" in pitfalls["ddp_prefix"]["our_error"]
    sampler = pitfalls["forgot_sampler"]
    assert sampler["max_abs_diff"] > 0 and sampler["samples_seen_more_often"] > 0
    assert sampler["batches_different"] == sampler["batches_after_resume"]
    assert pitfalls["forgot_rng"]["max_abs_diff"] > 0
    assert pitfalls["loader_without_generator"]["max_abs_diff"] > 0
    # 3 ranks: the order of a sum matters; settling DDP's buckets first keeps it exact
    assert results["buckets"]["world_size"] == 3
    assert results["buckets"]["max_abs_diff_settled"] == 0.0
    assert results["buckets"]["max_abs_diff_not_settled"] > 0


@pytest.mark.slow
def test_under_torchrun_the_relaunching_parts_are_skipped_not_hung(out_dir):
    stale = out_dir / "chapter07" / "restart.png"  # from an earlier run with python
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"an earlier run's figure")
    run = run_script("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     SCRIPT, "--quick", "--out", str(out_dir), timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    results = load_results(out_dir, 7)
    assert results["provenance"]["launcher"] == "torchrun"
    for key in ("resume", "dcp", "restart"):
        assert "needs several launches" in results[key]["skipped"]
    assert results["pitfalls"]["every_rank_saves"]["error"]
    assert_png(out_dir / "chapter07" / "cost.png")
    assert not stale.exists(), "a figure this run did not draw must not survive"


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "1"], "needs --world-size 2 or more"),
    (["--train"], "--train needs --ckpt-dir"),
    (["--crash-at-step", "3"], "--crash-at-step goes with --train"),
    (["--train", "--ckpt-dir", "d", "--crash-at-step", "400"], r"the run has 400 steps, choose"),
    (["--train", "--ckpt-dir", "d", "--quick", "--crash-at-step", "-1"], r"48 steps \(--quick\)"),
])
def test_bad_flags_are_one_clear_line(argv, message, tmp_path):
    import chapter07_checkpointing as chapter

    with pytest.raises(ddplab.UsageError, match=message):
        chapter.parse_args([*argv, "--out", str(tmp_path)])


def test_a_non_empty_ckpt_dir_is_refused(tmp_path):
    import argparse

    from backstage import chapter07_report

    (tmp_path / "old.pt").write_text("x")
    with pytest.raises(ddplab.UsageError, match="is not empty"):
        chapter07_report.work_directory(argparse.Namespace(ckpt_dir=tmp_path))

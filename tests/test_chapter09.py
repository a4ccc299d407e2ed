"""Chapter 09 end to end (--quick): hooks on both DDPs, autocast, the scaler's skip, bytes,
the cost model's prediction, the link table, figures."""

from __future__ import annotations

import pytest
from conftest import PROVENANCE_KEYS, assert_png, load_results, run_script

SCRIPT = "scripts/chapter09_compression.py"
HOOKS = ("none", "fp16", "bf16", "powersgd")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("ch09")
    run = run_script(SCRIPT, "--quick", "--out", str(out), timeout=600)  # a loaded CI box
    assert run.returncode == 0, run.stderr[-3000:]
    return run, out, load_results(out, 9)


@pytest.mark.slow
def test_quick_run_writes_every_figure_and_its_provenance(spawned):
    run, out, results = spawned
    for name in ("training.png", "prediction.png", "links.png"):
        assert_png(out / "chapter09" / name)
    assert results["provenance"].keys() >= PROVENANCE_KEYS
    assert results["provenance"]["quick"] is True
    assert "bit for bit" in run.stdout
    assert sorted(results["sweep"]) == ["1", "2"]


@pytest.mark.slow
def test_same_hook_on_both_ddps_and_autocast_give_the_same_bits(spawned):
    equivalence = spawned[2]["equivalence"]
    for key, value in equivalence.items():
        if key not in ("steps", "autocast_text"):  # a count, and the page's sentence
            assert value == 0.0, key   # 2 ranks: element-wise sums of two numbers
    assert equivalence["autocast_text"] == "the same bits"


@pytest.mark.slow
def test_every_rank_skips_together_only_with_ddp(spawned):
    skip = spawned[2]["scaler_skip"]
    assert skip["ddp"] == [True, True]       # the averaged inf reached rank 0 too
    assert skip["local"] == [False, True]    # without averaging only rank 1 skips


@pytest.mark.slow
def test_bytes_are_counted_and_compression_sends_fewer(spawned):
    per_hook, hooks = spawned[2]["per_hook"], spawned[2]["hooks"]
    assert per_hook["fp16"]["bytes_saved_x"] == 2.0 and per_hook["bf16"]["bytes_saved_x"] == 2.0
    assert per_hook["powersgd"]["bytes_saved_x"] > 10
    assert hooks["none"]["payload_bytes"] == 4 * spawned[2]["parameters"]
    assert hooks["powersgd"]["calls"] == 3           # the rest, P, Q


@pytest.mark.slow
def test_training_learns_with_every_hook(spawned):
    for world, runs in spawned[2]["sweep"].items():
        for hook in HOOKS:
            loss = runs[hook]["loss"]
            assert sum(loss[-10:]) < sum(loss[:10]), (world, hook)  # means: one step is noisy


@pytest.mark.slow
def test_prediction_and_link_table_are_recorded(spawned):
    results = spawned[2]
    prediction = results["prediction"]
    assert set(prediction["per_hook"]) == set(HOOKS)
    for row in prediction["per_hook"].values():
        assert row["predicted_ms"] > 0 and row["measured_ms"] > 0
        assert row["rel_err"] == pytest.approx((row["predicted_ms"] - row["measured_ms"])
                                               / row["measured_ms"])
    table = results["where_it_pays"]["speedup"]
    assert set(table) == {"this", "1B"}
    # On NVLink a 1 B model's plain gradient is 4 GB: fp16 halves the bytes, the cast is cheap.
    assert table["1B"]["nvlink4"]["fp16_h100"] > 1.0
    assert results["where_it_pays"]["billion"]["buckets"] == 15   # never a split parameter


@pytest.mark.slow
def test_powersgd_recovers_from_one_overflow_and_torchs_does_not(spawned):
    overflow = spawned[2]["powersgd_overflow"]
    assert overflow["ours"]["skipped_after"] == 0
    assert overflow["torch"]["skipped_after"] == overflow["steps_after"]
    assert overflow["ours"]["skipped"][overflow["overflow_step"]]   # the overflow itself skips


def test_too_few_steps_is_one_clear_line():
    run = run_script(SCRIPT, "--steps", "5", timeout=60)
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert "--steps must be above 11" in last and "PowerSGD" in last

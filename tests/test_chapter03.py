"""Chapter 03 end to end (--quick): the checks pass, every figure is drawn, results.json keys."""

from __future__ import annotations

import math

import pytest
from conftest import PROVENANCE_KEYS, assert_png, load_results, run_quick, run_script

SCRIPT = "scripts/chapter03_ring_allreduce.py"
FIGURES = ("ring_steps.png", "time.png", "busbw.png", "segments.png")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return run_quick(tmp_path_factory, SCRIPT, 3)


@pytest.mark.slow
def test_quick_run_finishes_in_a_minute_and_draws_every_figure(quick):
    run, out, results = quick
    assert run.seconds < 60
    for name in (*FIGURES, "scaling.png"):
        assert_png(out / "chapter03" / name)
    assert results["provenance"].keys() >= PROVENANCE_KEYS
    assert results["provenance"]["quick"] is True
    assert "ring/native busbw at" in run.stdout


@pytest.mark.slow
def test_results_have_the_keys_the_page_uses(quick):
    _, _, results = quick
    assert results["correct"] is True
    assert results["correctness"]["integers_exact"] is True
    sizes = [str(s) for s in results["sizes_bytes"]]
    for impl in ("ring", "native", "naive"):
        assert list(results["busbw_gbps"][impl]) == sizes
        assert all(v > 0 for v in results["busbw_gbps"][impl].values())
    assert list(results["ratio_ring_to_native_busbw"]) == sizes
    for impl in ("ring", "native"):
        fit = results["alpha_beta"][impl]
        assert fit.keys() >= {"alpha_us", "beta_gbps", "r2"}
        assert math.isfinite(fit["r2"]) and fit["alpha_us"] >= 0
        # --quick's sizes may be too small to see bandwidth: then β is reported as unknown.
        assert fit["beta_gbps"] is None or fit["beta_gbps"] > 0


@pytest.mark.slow
def test_busbw_is_algbw_times_2_n_minus_1_over_n(quick):
    _, _, results = quick
    n = results["provenance"]["world_size"]
    for size, t in results["time_ms"]["ring"].items():
        algbw = int(size) / (t * 1e-3) / 1e9
        assert results["busbw_gbps"]["ring"][size] == pytest.approx(algbw * 2 * (n - 1) / n)


@pytest.mark.slow
def test_world_size_sweep_covers_2_3_4_ranks_and_the_trace_uses_the_largest(quick):
    _, _, results = quick
    assert results["scaling"]["world_sizes"] == [2, 3, 4]
    assert set(results["scaling"]["time_ms"]["ring"]) == {"2", "3", "4"}
    assert results["trace_world_size"] == 4


@pytest.mark.slow
def test_under_torchrun_the_sweep_is_skipped_with_a_note(out_dir):
    run = run_script("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     SCRIPT, "--quick", "--out", str(out_dir))
    assert run.returncode == 0, run.stderr
    results = load_results(out_dir, 3)
    assert "skipped under torchrun" in results["scaling"]["skipped"]
    assert results["provenance"]["launcher"] == "torchrun"
    assert results["correct"] is True
    for name in FIGURES:
        assert_png(out_dir / "chapter03" / name)

"""Chapter 05 end to end (--quick): equivalence, speed, memory, sharding, scaling, figures."""

from __future__ import annotations

import pytest
from conftest import (
    PROVENANCE_KEYS,
    assert_png,
    load_results,
    refuse_in_process,
    run_quick,
    run_script,
)

SCRIPT = "scripts/chapter05_data_parallel.py"
FIGURES = ("equivalence.png", "speed.png", "sharding.png")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return run_quick(tmp_path_factory, SCRIPT, 5)


@pytest.mark.slow
def test_quick_run_is_quick_and_writes_every_figure(spawned):
    run, out, results = spawned  # its wall time is a benchmark (make bench), not a test
    for name in (*FIGURES, "scaling.png"):
        assert_png(out / "chapter05" / name)
    assert results["provenance"].keys() >= PROVENANCE_KEYS
    assert results["provenance"]["quick"] is True
    assert "bit for bit" in run.stdout
    # Ranks end without the interpreter's teardown, but after their atexit handlers: else
    # multiprocessing reports tqdm's lock as a "leaked semaphore" when the run ends.
    assert "leaked" not in run.stderr


@pytest.mark.slow
def test_results_have_the_keys_the_page_relies_on(spawned):
    results = spawned[2]
    assert set(results["equivalence"]) == {"naive_vs_native", "bucketed_vs_native",
                                           "ddp_vs_single_process", "no_sync_vs_large_batch"}
    for variant in ("local", "naive", "bucketed", "native"):
        assert results["step_time_ms"][variant] > 0
    assert set(results["ratio_to_native"]) >= {"naive", "bucketed"}
    memory = results["peak_memory_mb"]
    assert set(memory) == {"local", "naive", "bucketed", "native", "native_view"}
    for variant, phases in memory.items():
        assert phases["setup"] > 0, variant
        assert phases["steady"] > 0, variant
    assert results["memory"]["fresh_process_per_variant"] is False  # --quick: one process


@pytest.mark.slow
def test_hand_written_ddp_matches_native_bit_for_bit_on_two_ranks(spawned):
    # 2 ranks: every element is a/2 + b/2 in all three, and that sum does not depend on order.
    equivalence = spawned[2]["equivalence"]
    assert equivalence["naive_vs_native"] == 0.0
    assert equivalence["bucketed_vs_native"] == 0.0
    # One process sums the global batch in another order: float32 rounding, not more.
    assert 0.0 <= equivalence["ddp_vs_single_process"] < 1e-5
    assert 0.0 <= equivalence["no_sync_vs_large_batch"] < 1e-5


@pytest.mark.slow
def test_training_learns_and_naive_makes_one_call_per_parameter(spawned):
    results = spawned[2]
    loss = results["training"]["loss"]["native"]
    assert loss[-1] < loss[0]
    assert results["training"]["test_accuracy"] > 0.3  # 10 classes: chance is 0.1
    calls = results["why_naive_is_slower"]["allreduce_calls"]
    assert calls["naive"] == results["model"]["parameter_tensors"]
    assert calls["bucketed"] == calls["native"] == 3  # 8 MiB of gradients, 4 MiB buckets


@pytest.mark.slow
def test_sharding_and_scaling(spawned):
    results = spawned[2]
    sharding = results["sharding"]
    assert sharding["never_seen"] == {"manual": [9], "padded": [], "drop_last": [9]}
    assert sharding["seen_twice"]["padded"] == [0, 1]
    assert sharding["orders_repeat_without_set_epoch"] is True
    orders = sharding["rank0_order_by_epoch"]["with_set_epoch"]
    assert orders[0] != orders[1]
    # --quick sweeps 1 rank and the run's own world size (the full run adds 4).
    assert [p["world_size"] for p in results["scaling"]["points"]] == [1, 2]


@pytest.mark.slow
def test_torchrun_skips_the_world_size_sweep_with_a_note(tmp_path):
    run = run_script("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     SCRIPT, "--quick", "--out", str(tmp_path), timeout=180)
    assert run.returncode == 0, run.stderr
    results = load_results(tmp_path, 5)
    assert results["provenance"]["launcher"] == "torchrun"
    assert "torchrun" in results["scaling"]["skipped"]
    assert "Scaling sweep skipped" in run.stdout
    assert results["equivalence"]["bucketed_vs_native"] == 0.0
    for name in FIGURES:
        assert_png(tmp_path / "chapter05" / name)


@pytest.mark.parametrize(("argv", "message"), [
    (["--micro-batches", "3"], "--micro-batches must divide"),
    (["--micro-batches", "0"], "--micro-batches: must be positive, got 0"),
    (["--bucket-cap-mb", "-1"], "--bucket-cap-mb: must be positive, got -1"),
    (["--bucket-cap-mb", "lots"], "--bucket-cap-mb: 'lots' is not a number"),
])
def test_bad_flags_are_one_clear_line(argv, message, tmp_path):
    code, err = refuse_in_process(SCRIPT, *argv, "--out", str(tmp_path))
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err

"""Chapter 04 end to end (--quick): hooks, gradient-ready order, overlap timelines, sweep."""

from __future__ import annotations

import json

import pytest
from conftest import PROVENANCE_KEYS, assert_png, run_quick

SCRIPT = "scripts/chapter04_hooks.py"


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return run_quick(tmp_path_factory, SCRIPT, 4)


@pytest.mark.slow
def test_quick_run_writes_figures_trace_and_provenance(spawned):
    _, out, results = spawned
    for name in ("hooks.png", "ready_order.png", "overlap.png", "bucket_sweep.png"):
        assert_png(out / "chapter04" / name)
    trace = json.loads((out / "chapter04" / "overlap_trace.json").read_text())
    assert any(e.get("cat") == "comm" for e in trace["traceEvents"])
    assert results["provenance"].keys() >= PROVENANCE_KEYS


@pytest.mark.slow
def test_hook_order_and_the_post_accumulate_trap(spawned):
    results = spawned[2]
    kinds = [e["kind"] for e in results["hook_order"]]
    assert kinds[:4] == ["forward pre-hook", "forward hook"] * 2
    assert kinds[-2:] == ["queued callback", "backward returned"]  # before backward returns
    accumulated = [e["where"] for e in results["hook_order"]
                   if e["kind"] == "post-accumulate-grad hook"]
    assert accumulated == ["2.bias", "2.weight", "0.bias", "0.weight"]
    trap = results["post_accumulate_trap"]
    assert trap["hook_received_the_parameter"] is True
    assert trap["parameter_after"] == [0.5, 0.5, 0.5]  # the hook halved the parameter
    assert trap["gradient_after"] == [1.0, 2.0, 3.0]   # and not the gradient


@pytest.mark.slow
def test_gradients_become_ready_in_reverse_order(spawned):
    ready = spawned[2]["gradient_ready"]
    assert ready["rank_correlation_with_forward_order"] < -0.9
    assert ready["ready_order"][-1].startswith("embed.")
    assert ready["buckets"][0][0] == "head.bias"  # bucket 0 holds the last layer


@pytest.mark.slow
def test_overlap_timelines_and_bucket_sweep(spawned):
    results = spawned[2]
    for key in ("overlap", "no_overlap"):
        events = results["overlap"]["timelines"][key]
        comm = [e for e in events if e["cat"] == "comm" and e["rank"] == 0]
        assert [e["name"] for e in comm] == [f"bucket {i}" for i in range(len(comm))]
        backward_end = max(e["end_ms"] for e in events if e["cat"] == "backward"
                           and e["rank"] == 0)
        starts_before_backward_ends = comm[0]["start_ms"] < backward_end
        assert starts_before_backward_ends == (key == "overlap")
    points = results["bucket_sweep"]["points"]
    assert [p["buckets"]["bucketed"] for p in points][-1] == 1  # a huge cap: one bucket
    assert all(p["step_time_ms"]["native"] > 0 for p in points)
    assert results["bucket_sweep"]["same_bucket_counts_as_native"] is True  # the same rule


@pytest.mark.slow
def test_both_ranks_wait_and_native_default_cap_is_not_25(spawned):
    results = spawned[2]
    for key in ("overlap", "no_overlap"):
        phases = results["overlap"]["phases_ms"][key]
        assert set(phases) == {"rank0", "rank1"}
        assert all(p["wait"] >= 0 and p["backward"] > 0 for p in phases.values())
    default = results["bucket_sweep"]["default_cap"]
    # bucket_cap_mb=None: one bucket in the first iteration, then rebuilt with a 1 MiB first one
    assert default["native_default"]["first_iteration"]["count"] == 1
    assert default["native_default"]["rebuilt"]["count"] == 2
    assert default["native_default"]["rebuilt"]["mib"][0] <= 1.1
    assert default["native_cap_25"]["rebuilt"]["count"] == 1  # the 8 MiB model fits one bucket

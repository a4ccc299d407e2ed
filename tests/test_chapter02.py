"""Chapter 02 end to end (--quick): every collective drawn from the tensors the run produced."""

from __future__ import annotations

import math

import pytest
from conftest import (
    PROVENANCE_KEYS,
    assert_png,
    launch_forked,
    refuse_in_process,
    run_quick,
)

SCRIPT = "scripts/chapter02_collectives.py"
COLLECTIVES = ("send_recv", "broadcast", "scatter", "gather", "reduce", "all_gather",
               "all_reduce", "reduce_scatter", "all_to_all")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return run_quick(tmp_path_factory, SCRIPT, 2)  # the default: 4 CPU ranks


@pytest.mark.slow
def test_quick_run_draws_one_figure_per_collective(quick):
    run, out, results = quick
    for name in COLLECTIVES:
        assert_png(out / "chapter02" / f"{name}.png")
        assert name in run.stdout  # each rank's before and after is printed
    assert results["provenance"].keys() >= PROVENANCE_KEYS
    assert results["provenance"]["world_size"] == 4


@pytest.mark.slow
def test_the_recorded_tensors_are_what_each_collective_promises(quick):
    _, _, results = quick
    states, n = results["states"], results["provenance"]["world_size"]
    rows = [[10 * (r + 1) + j for j in range(n)] for r in range(n)]
    column_sums = [sum(col) for col in zip(*rows, strict=True)]
    assert states["broadcast"]["after"] == [rows[0]] * n
    assert states["all_reduce"]["after"] == [column_sums] * n
    assert states["reduce"]["after"][0] == column_sums
    assert states["reduce_scatter"]["after"] == [[s] for s in column_sums]
    assert states["scatter"]["after"] == [[v] for v in rows[0]]
    assert states["gather"]["after"][0] == [row[0] for row in rows]
    assert states["all_gather"]["after"] == [[row[0] for row in rows]] * n
    assert states["all_to_all"]["after"] == [list(col) for col in zip(*rows, strict=True)]
    assert states["send_recv"]["after"] == [rows[(r - 1) % n] for r in range(n)]


@pytest.mark.slow
def test_traffic_table_and_gloo_support(quick):
    _, _, results = quick
    n, s = results["provenance"]["world_size"], results["timed_bytes"]
    table = results["collectives"]
    assert table["all_reduce"]["sent_bytes"] == pytest.approx(2 * (n - 1) / n * s)
    # what gloo runs: reduce-scatter as all-reduces; broadcast a binomial tree (the root sends S
    # to ⌈log₂N⌉ peers); reduce a ring reduce-scatter, then a gather to the root
    for name in ("reduce_scatter", "reduce_scatter_flat"):
        assert table[name]["sent_bytes"] == pytest.approx(2 * (n - 1) / n * s)
    assert table["reduce"]["sent_bytes"] == pytest.approx(s)
    assert table["broadcast"]["sent_bytes"] == pytest.approx(math.ceil(math.log2(n)) * s)
    assert table["reduce"]["received_bytes"] == pytest.approx(2 * (n - 1) / n * s)
    assert results["fallbacks"] == [] if results["support"]["reduce_scatter"] == "ok" else [
        "reduce_scatter"]
    assert all(row["time_ms"] > 0 for row in table.values())
    assert results["api"]["reduce_scatter_flat"].startswith("reduce_scatter_")
    assert "reduce_scatter_flat" in table
    support = results["support"]
    assert {"reduce_scatter", "reduce_scatter_flat", "all_to_all_single"} <= support.keys()
    assert support["all_to_all_single"] == "ok"  # gloo has had it since torch 1.x
    # "ok" means the call returned and every output element held the value it must.
    assert all(v == "ok" or v.startswith("error: ") for v in support.values()), support


def test_one_rank_is_refused_with_one_line(out_dir):
    code, err = refuse_in_process(SCRIPT, "--world-size", "1", "--out", str(out_dir))
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("error: chapter 02 needs at least 2")


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_old_gloo_fallback_for_reduce_scatter_gives_the_same_pieces(world_size, tmp_path):
    import collective_workers

    import ddplab

    args = ddplab.parse_chapter_args(ddplab.chapter_parser("test"),
                                     ["--world-size", str(world_size), "--out", str(tmp_path)])
    assert launch_forked(collective_workers.fallback_matches_reduce_scatter, args).result

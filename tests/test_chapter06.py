"""Chapter 06 end to end: one --quick run (mp.spawn, 2 gloo ranks) shared by every check."""

from __future__ import annotations

import json

import pytest
from conftest import PROVENANCE_KEYS, assert_png, refuse_in_process, run_quick, run_script

from backstage import chapter06_report
from ddplab import stragglers

SCRIPT = "scripts/chapter06_bubbles.py"
FIGURES = ["timeline_native.png", "timeline_bucketed.png", "straggler.png",
           "straggler_timeline.png", "sync_points.png", "syncbn_timeline.png", "rank0_work.png",
           "uneven_join.png"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    return run_quick(tmp_path_factory, SCRIPT, 6, "--world-size", "2")


@pytest.mark.slow
def test_quick_run_is_complete(quick):
    run, out, results = quick   # its wall time is a benchmark (make bench), not a test
    assert results["provenance"].keys() >= PROVENANCE_KEYS
    assert results["provenance"]["quick"] is True
    for name in FIGURES:
        assert_png(out / "chapter06" / name)
    # The straggler keys results.json promises, with their types.
    s = results["straggler"]
    assert len(s["delay_ms"]) == len(s["step_time_ms"]) == len(s["idle_ms_fast_ranks"]) >= 2
    assert set(results["syncbn"]["step_time_ms"]) == {"bn", "syncbn"}
    assert isinstance(results["uneven"]["join_completed"], bool)
    assert isinstance(results["uneven"]["without_join"], str)
    # The hang demos fail on purpose, quietly: no traceback, no native-code noise on stderr.
    assert "Traceback" not in run.stderr and "USDT" not in run.stderr
    assert "uneven inputs [6, 5] batches" in run.stdout


@pytest.mark.slow
def test_traces_are_chrome_traces_with_every_rank(quick):
    _, out, results = quick
    assert set(results["trace_files"]) >= {"trace_native_ddp.json", "trace_bucketed_ddp.json",
                                           "trace_straggler.json"}
    for name in results["trace_files"]:
        trace = json.loads((out / "chapter06" / name).read_text())
        events = trace["traceEvents"]
        spans = [e for e in events if e["ph"] == "X"]
        named = {e["pid"]: e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "process_name"}
        assert named == {0: "rank 0", 1: "rank 1"}
        for e in spans:
            assert {"name", "cat", "ts", "dur", "pid", "tid"} <= e.keys()
            assert e["dur"] >= 0 and e["ts"] >= 0
        for rank in (0, 1):  # every rank did compute and communicated
            cats = {e["cat"] for e in spans if e["pid"] == rank}
            assert {"forward", "backward", "comm"} <= cats, (name, rank, cats)


@pytest.mark.slow
def test_the_reported_slopes_are_the_datas(quick):
    # How close the slope comes to 1 is a timing relation: make bench measures it
    # (tools/bench.py, SLOPE_TARGET); a loaded machine stretches the steps, not the code.
    _, _, results = quick
    s = results["straggler"]
    for sweep in (s, s["bucketed"]):
        slope, _ = stragglers.fit_line(sweep["delay_ms"], sweep["idle_ms_fast_ranks"])
        assert slope == pytest.approx(sweep["slope_idle"])
        slope, _ = stragglers.fit_line(sweep["delay_ms"], sweep["step_time_ms"])
        assert slope == pytest.approx(sweep["slope_step_time"])
    assert len(s["bucketed"]["wait_span_ms_fast_ranks"]) == len(s["delay_ms"])


def test_a_sweep_summary_from_given_timings():
    # Rank 1 is late by each delay; rank 0 (fast) idles exactly that long, plus 2 ms of
    # communication; rank 2 (fast) idles 1 ms more.  The step is as slow as the slowest rank.
    delays = [0.0, 10.0, 20.0, 40.0]
    ranks = [{"idle_ms": [d + 2 for d in delays], "step_ms": [d + 30 for d in delays],
              "wait_span_ms": [d + 1 for d in delays]},
             {"idle_ms": [2.0, 2.0, 2.0, 2.0], "step_ms": [d + 31 for d in delays],
              "wait_span_ms": [0.0] * 4},
             {"idle_ms": [d + 3 for d in delays], "step_ms": [d + 29 for d in delays],
              "wait_span_ms": [d + 2 for d in delays]}]
    summary = chapter06_report.summarize_sweep({"per_rank": ranks}, delays, slow_rank=1)
    assert summary["idle_ms_fast_ranks"] == [2.5, 12.5, 22.5, 42.5]
    assert summary["slope_idle"] == 1.0 and summary["intercept_idle_ms"] == 2.5
    assert summary["step_time_ms"] == [31.0, 41.0, 51.0, 71.0]
    assert summary["slope_step_time"] == 1.0 and summary["intercept_step_time_ms"] == 31.0
    assert summary["idle_ms_slow_rank"] == [2.0, 2.0, 2.0, 2.0]
    assert summary["wait_span_ms_fast_ranks"] == [1.5, 11.5, 21.5, 41.5]


@pytest.mark.slow
def test_uneven_inputs_join_and_sampler(quick):
    _, _, results = quick
    u = results["uneven"]
    assert u["batches_per_rank"] == [6, 5]  # 101 samples, batches of 10, strided over 2 ranks
    assert u["join_completed"] is True
    assert u["join_max_abs_diff_params"] == 0.0  # Join ends with the replicas equal
    assert all("exhausted" in message for message in u["throw_on_early_termination"])
    assert sum(u["collectives_per_step"]["with_join"].values()) > sum(
        u["collectives_per_step"]["without_join"].values())
    assert u["sampler"]["padded"] == {"samples_per_rank": [51, 51], "batches_per_rank": [6, 6],
                                      "repeated_samples": 1, "dropped_samples": 0}
    assert u["sampler"]["drop_last"]["samples_per_rank"] == [50, 50]
    assert u["sampler"]["drop_last"]["dropped_samples"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("demo", ["without_join", "rank0_only_collective"])
def test_hang_demos_time_out_with_the_documented_error(quick, demo):
    _, _, results = quick
    if demo == "without_join":
        d = results["uneven"]["without_join_demo"]
        assert results["uneven"]["without_join"] == f"timeout after {d['timeout_s']:g} s"
        assert "backward" in d["stuck_in"] or "barrier" in d["stuck_in"]
    else:
        d = results["sync_points"]["rank0_only_collective"]
        assert "all_reduce" in d["stuck_in"] or "barrier" in d["stuck_in"]
    # Each rank's flight recorder: the same sequence number, different collectives (rank 0 in
    # the evaluation's all_reduce or the extra step's bucket, rank 1 already in the barrier).
    recorder = d["flight_recorder"]
    assert set(recorder) == {"rank_0", "rank_1"}
    last = {rank: entries[-1].split() for rank, entries in recorder.items()}
    assert last["rank_0"][0] == last["rank_1"][0]                 # "#<seq>"
    assert last["rank_0"][1] == "gloo:all_reduce" and last["rank_1"][1] == "gloo:barrier"
    assert d["timed_out"] is True
    assert "Timed out waiting" in d["error"]
    # Ended by the demo's own short timeout (not the 30-minute default, not another error).
    assert f"{d['timeout_s'] * 1000:.0f}ms" in d["error"]


@pytest.mark.slow
def test_sync_points_are_counted_and_syncbn_matches_the_full_batch(quick):
    _, _, results = quick
    bn = results["syncbn"]
    calls = {k: bn["collectives_per_step"][k] for k in ("bn", "syncbn")}
    # Three BatchNorm layers, one all-reduce in forward and one in backward each, plus DDP's
    # single gradient bucket (the CNN is smaller than BUCKET_MB).
    assert calls["bn"]["all_reduce"] == 1
    assert calls["syncbn"]["all_reduce"] == 6 + 1
    assert calls["bn"]["broadcast"] >= 1  # DDP broadcasts BatchNorm's buffers every forward
    # forward_sync_buffers=False (or the fallback) removes exactly those broadcasts.
    assert bn["broadcasts_per_step"] == {"default": calls["syncbn"]["broadcast"],
                                         "forward_sync_off": 0}
    assert bn["collectives_per_step"]["syncbn_forward_sync_off"]["all_reduce"] == 7
    # Gradients against one process on the whole batch: SyncBN to float32 rounding, plain BN
    # (per-shard statistics) visibly off.
    assert bn["max_abs_grad_diff_vs_full_batch"]["syncbn"] < 1e-5
    assert bn["max_abs_grad_diff_vs_full_batch"]["bn"] > 1e-4
    assert "only work with GPU" in bn["native_on_cpu_error"]
    metric = results["sync_points"]["metric_reduction"]["collectives_per_step"]
    assert metric["with"]["all_reduce"] == metric["without"]["all_reduce"] + 1
    # At 2 ranks (a power of two) the hook's div_(2) equals DDP's * 0.5: the same bits.
    assert results["hook"]["max_abs_diff_params"] == 0.0
    # Idle at d = 0 waits for a queue of buckets, not only the last one.
    assert results["buckets_in_flight_at_last_launch"] >= 1
    work = results["sync_points"]["rank0_work"]
    assert work["idle_ms_other_ranks"] > 0.5 * work["eval_ms"]  # they waited for rank 0


def test_the_rank_that_timed_out_is_blamed_not_the_peer_it_cut_off(tmp_path):
    """A gloo timeout closes the rank's sockets at once, so its peer can fail ("Connection
    closed by peer") and claim the failure first; the hang demos must still name the timeout."""
    from ddplab.run.launch import _root_cause

    reports = {0: "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:942",
               1: "RuntimeError: [unbound_buffer.cc:78] Timed out waiting 3000ms for recv"}
    for rank, summary in reports.items():
        (tmp_path / f"error-rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "first": 0, "summary": summary, "traceback": summary}))
    blamed = _root_cause(tmp_path, 0)
    assert blamed.rank == 1 and "Timed out waiting" in str(blamed)


def test_bad_flags_are_one_clear_line(tmp_path):
    code, err = refuse_in_process(SCRIPT, "--delays", "0,x", "--out", str(tmp_path))
    assert code == 2
    assert "--delays" in err and "Traceback" not in err
    code, err = refuse_in_process(SCRIPT, "--world-size", "1", "--out", str(tmp_path))
    assert code == 2
    assert "at least 2 ranks" in err


@pytest.mark.slow
def test_figures_redraw_from_results_json_alone(quick, tmp_path):
    """--replot draws every figure from results.json (scripts/drawing/chapter06.py), no rank."""
    _, out, _ = quick
    folder = tmp_path / "chapter06"
    folder.mkdir()
    (folder / "results.json").write_bytes((out / "chapter06" / "results.json").read_bytes())
    run = run_script(SCRIPT, "--replot", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr
    for name in FIGURES:
        assert_png(folder / name)
    missing = run_script(SCRIPT, "--replot", "--out", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr

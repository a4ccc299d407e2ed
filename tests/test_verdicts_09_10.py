"""Chapters 09 and 10 say what their numbers say: verdicts computed from the results, rendered
into the page, so a run that measures otherwise changes the sentence.  Also: one link table, one
ring formula, and the 1 B model in DDP's real buckets."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import chapter10_many_nodes as ch10
import mkdocs_hooks
import pytest

from backstage import chapter10_report, chapter10_verdicts
from ddplab import costmodel, hook_costmodel

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20
HOOKS = {"none": {"measured_ms": 9.0, "compute_ms": 1.0, "calls": 1, "payload_bytes": 8 * MiB},
         "fp16": {"measured_ms": 10.0, "compute_ms": 2.0, "calls": 1, "payload_bytes": 4 * MiB},
         "bf16": {"measured_ms": 8.0, "compute_ms": 2.0, "calls": 1, "payload_bytes": 4 * MiB},
         "powersgd": {"measured_ms": 10.0, "compute_ms": 7.0, "calls": 3,
                      "payload_bytes": 2**17}}
MODEL = {"alpha_s": 1e-4, "bytes_per_s": 2e9, "gamma_s_per_byte": 1e-10,
         "median_over_fit": {"4194304": 1.5, "8388608": 1.2}}


def render_page(page: str, results: dict, chapter: str, monkeypatch) -> str:
    """The page's markdown with its placeholders filled from ``results`` (for ``chapter``)."""
    real = mkdocs_hooks.load_results
    monkeypatch.setattr(mkdocs_hooks, "load_results",
                        lambda ch: results if ch == chapter else real(ch))
    markdown = (REPO / "docs" / "chapters" / page).read_text()
    return mkdocs_hooks.on_page_markdown(markdown, SimpleNamespace(
        file=SimpleNamespace(src_uri=page)), None, None)


def test_a_parameter_is_never_split_across_buckets():
    buckets = costmodel.parameter_buckets([(16384, 4096), (10,), (4096, 16384)], 25 * MiB)
    assert buckets == [[(4096, 16384)], [(10,), (16384, 4096)]]  # reverse definition order
    big = hook_costmodel.billion_model(rank=2)
    assert big["buckets"] == big["matrices"] == 15     # each 256 MiB matrix alone


def test_one_ring_formula_and_one_link_table():
    h = HOOKS["powersgd"]
    comm = costmodel.ring_time(h["payload_bytes"], 2, MODEL["alpha_s"], MODEL["bytes_per_s"],
                               MODEL["gamma_s_per_byte"], calls=3)
    assert hook_costmodel.predict_hook_ms(h, 2, MODEL) == pytest.approx(
        comm * 1e3 + h["compute_ms"])
    pays = hook_costmodel.where_it_pays(HOOKS, 2_000_000, 8, MODEL, rank=2)
    for key, link in costmodel.LINKS.items():
        assert pays["links"][key]["alpha_s"] == link.alpha_us * 1e-6
        assert pays["links"][key]["bytes_per_s"] == link.gbytes_per_s * 1e9
    cal = ch10.calibration(Path("/nonexistent"))
    fit = costmodel.chapter03_calibration(Path("/nonexistent"))
    assert cal["alpha_us"] == pytest.approx(fit["alpha_s"] * 1e6)
    assert cal["gamma_s_per_byte"] == fit["gamma_s_per_byte"] > 0   # a re-run carries γ


def test_prediction_verdict_follows_the_numbers():
    verdict = hook_costmodel.prediction(HOOKS, 2, MODEL)
    assert verdict["direction_text"] == "below the measured time for every hook"
    slow = copy.deepcopy(HOOKS)
    slow["powersgd"]["measured_ms"] = 1.0         # now the model is pessimistic for one hook
    flipped = hook_costmodel.prediction(slow, 2, MODEL)
    assert flipped["direction_text"] == "below for 3 hooks and above for 1"
    assert flipped["most_off"] == "powersgd"


def test_chapter09_page_sentence_changes_with_results_json(monkeypatch):
    results = json.loads((REPO / "figures/chapter09/results.json").read_text())
    before = render_page("09-compression.md", results, "09", monkeypatch)
    changed = copy.deepcopy(results)
    changed["where_it_pays"]["verdict"]["1B"]["h100"]["nvlink4"]["text"] = "SENTINEL pays"
    changed["prediction"]["direction_text"] = "SENTINEL direction"
    after = render_page("09-compression.md", changed, "09", monkeypatch)
    assert "SENTINEL" not in before
    assert "Inside one NVLink machine: SENTINEL pays" in after
    assert "The prediction is SENTINEL direction" in after


def test_chapter10_verdicts_and_page_follow_the_numbers(monkeypatch):
    results = json.loads((REPO / "figures/chapter10/results.json").read_text())
    assert results["verdicts"] == chapter10_verdicts.verdicts(results, ch10.RATES,
                                                          ch10.BUCKET_CAP_MB * MiB)
    changed = copy.deepcopy(results)
    for run in changed["validation"]["runs"].values():     # every run predicted exactly
        run["predicted_ms"], run["rel_error"] = run["measured_ms"], 0.0
    changed["verdicts"] = chapter10_verdicts.verdicts(changed, ch10.RATES, ch10.BUCKET_CAP_MB * MiB)
    assert changed["verdicts"]["model"]["optimistic_beyond_15_percent"] == "none"
    page = render_page("10-many-nodes.md", changed, "10", monkeypatch)
    assert "Optimistic\n(predicting a faster step) by more: none;" in page


def at_alpha(monkeypatch, pick) -> dict:
    """``where_it_pays`` with every link's α set to ``pick(link)``, range collapsed to it."""
    from dataclasses import replace
    moved = {k: replace(v, alpha_us=pick(v), alpha_range_us=(pick(v), pick(v)))
             for k, v in costmodel.LINKS.items()}
    with monkeypatch.context() as m:
        m.setattr(hook_costmodel, "LINKS", moved)
        return hook_costmodel.where_it_pays(HOOKS, 2_000_000, 8, MODEL, rank=2)["verdict"]


def test_alpha_sensitivity_is_the_verdict_at_the_bottom_of_the_range(monkeypatch):
    verdict = hook_costmodel.where_it_pays(HOOKS, 2_000_000, 8, MODEL, rank=2)["verdict"]
    low = at_alpha(monkeypatch, lambda link: link.alpha_range_us[0])
    for model_name, per_compute in verdict.items():
        for where, per_link in per_compute.items():
            for key, link in costmodel.LINKS.items():
                ours, other = per_link[key], low[model_name][where][key]
                same = (ours["best_hook"] == other["best_hook"]
                        and (ours["speedup"] > 1) == (other["speedup"] > 1))
                assert ours["alpha_holds"] == same
                if not same:
                    assert ours["alpha_text"] == (f"at α {link.alpha_range_us[0]:.3g} µs "
                                                  f"instead: {other['text']}")


def test_every_link_takes_alpha_from_one_protocol_row():
    for key, link in costmodel.LINKS.items():
        low, high = link.alpha_range_us
        assert low <= link.alpha_us == high       # the table's α is the top of its range
        if key.startswith(("ib", "eth")):
            assert low == costmodel.NET_ALPHA_RANGE_US[0]


def test_calibration_says_which_run_and_machine(tmp_path):
    for chapter in ("chapter03", "chapter05"):
        (tmp_path / chapter).mkdir()
        (tmp_path / chapter / "results.json").write_text(
            (REPO / "figures" / chapter / "results.json").read_text())
    committed = ch10.calibration(REPO / "figures")
    yours = ch10.calibration(tmp_path)
    assert committed["run"] == "the committed run" and yours["run"] == "your run"
    assert "the committed run (figures)" in committed["source"]
    fit = costmodel.chapter03_calibration(tmp_path)
    provenance = json.loads((REPO / "figures/chapter03/results.json").read_text())["provenance"]
    assert (fit["run"], fit["device"], fit["measured"]) == (
        "your run", provenance["device"], provenance["date"])
    assert yours["chapter03"]["device"] == provenance["device"]


def test_pages_render_calibration_and_alpha_range_from_results(monkeypatch):
    r09 = json.loads((REPO / "figures/chapter09/results.json").read_text())
    r09["prediction"]["model"]["device"] = "SENTINEL-CPU"
    r09["where_it_pays"]["verdict"]["1B"]["h100"]["ib-ndr"]["alpha_text"] = "SENTINEL range"
    page = render_page("09-compression.md", r09, "09", monkeypatch)
    assert "measured on\nSENTINEL-CPU on" in page
    assert "(SENTINEL range)" in page
    r10 = json.loads((REPO / "figures/chapter10/results.json").read_text())
    r10["calibration"]["chapter05"]["device"] = "SENTINEL-05"
    r10["links"]["ib-ndr"]["alpha_us"] = 99.5
    page = render_page("10-many-nodes.md", r10, "10", monkeypatch)
    assert "measured on SENTINEL-05 on" in page
    assert "| 50 GB/s per port | 99.5 µs |" in page


def run_row(measured: float, predicted: float, own: float) -> dict:
    return {"measured_ms": measured, "predicted_ms": predicted,
            "rel_error": abs(predicted - measured) / measured,
            "rel_error_own_allreduce": abs(own - measured) / measured}


def test_chapter10_model_verdict_edges():
    runs = {"1x2_loopback": run_row(100.0, 85.0, 100.0),     # exactly 15 % off: within
            "2x2_unshaped": run_row(100.0, 100.0, 130.0),    # exact; the schedule alone is not
            "2x2_1gbit": run_row(100.0, 140.0, 100.0),       # pessimistic beyond 15 %
            "2x2_100mbit": run_row(100.0, 55.0, 84.0)}       # optimistic, and the most off
    v = chapter10_verdicts.model_verdict(runs)
    assert v["within_15_percent"] == "1 × 2 loopback, 2 × 2 unshaped"
    assert v["optimistic_beyond_15_percent"] == "2 × 2 at 100 Mbit/s"
    assert v["pessimistic_beyond_15_percent"] == "2 × 2 at 1 Gbit/s"
    assert v["schedule_beyond_15_percent"] == "2 × 2 unshaped, 2 × 2 at 100 Mbit/s"
    assert (v["most_off"], v["most_off_direction"]) == (
        "2 × 2 at 100 Mbit/s", "optimistic (a faster step than measured)")
    assert chapter10_verdicts.direction(runs["2x2_unshaped"]) == "exact"
    runs["2x2_1gbit"] = run_row(100.0, 145.0, 100.0)    # a tie, in opposite directions
    tie = chapter10_verdicts.model_verdict(runs)
    assert tie["most_off"] == "2 × 2 at 1 Gbit/s, 2 × 2 at 100 Mbit/s"
    assert tie["most_off_direction"] == "optimistic on one, pessimistic on another"
    assert chapter10_verdicts.direction(runs["2x2_1gbit"]).startswith("pessimistic")


def test_chapter10_cable_gamma_and_heard_edges():
    assert chapter10_verdicts.compare(10.0, 10.0) == "as long as"
    assert chapter10_verdicts.compare(4.0, 10.0) == "shorter than"
    assert chapter10_verdicts.compare(40.0, 10.0) == "longer than"
    for missing in (None, 0.0):
        assert chapter10_verdicts.gamma_text(missing).startswith("no γ")
    assert chapter10_verdicts.gamma_text(1e-10) == "γ from chapter 03: adding at 10 GB/s"
    assert chapter10_verdicts.heard(None) == "no error line that names the loss"
    assert chapter10_verdicts.heard("x: Read error: Connection reset by peer.") == (
        "Connection reset by peer")


def test_a_timeout_is_how_node_a_heard_even_when_a_siblings_closed_line_comes_first(tmp_path):
    # After a power cut the rank that times out exits; its sibling on node a may log "closed by
    # peer" about it first (seen in CI). The timeout is the cause; a kill's log has none.
    timeout = "RuntimeError: [unbound_buffer.cc:78] Timed out waiting 30000ms for recv"
    closed = "RuntimeError: [pair.cc:553] Connection closed by peer [10.213.0.1]:41234"
    log = tmp_path / "a.log"
    log.write_text(f"starting\n{closed}\nnoise\n{timeout}\n{closed}\n")
    assert chapter10_report.how_node_a_heard(log) == timeout
    log.write_text(f"starting\n  {closed}  \nW: closing signal SIGTERM\n")
    assert chapter10_report.how_node_a_heard(log) == closed
    log.write_text("starting\nfinished\n")
    assert chapter10_report.how_node_a_heard(log) is None


def test_chapter10_cable_sentence_follows_this_runs_backward(monkeypatch):
    results = json.loads((REPO / "figures/chapter10/results.json").read_text())
    phases = results["two_node"]["phases"]
    phases["1gbit"]["compute_ms"] = 1.0      # backward now far shorter than the all-reduce
    results["validation"]["runs"]["2x2_1gbit"]["compute_ms"] = 1.0
    results["verdicts"] = chapter10_verdicts.verdicts(results, ch10.RATES, ch10.BUCKET_CAP_MB * MiB)
    page = render_page("10-many-nodes.md", results, "10", monkeypatch)
    assert "longer than that run's backward\n(1 ms of a\n1.0 ms compute-only step)" in page
    results["calibration"]["gamma_s_per_byte"] = 2e-10
    results["verdicts"] = chapter10_verdicts.verdicts(results, ch10.RATES, ch10.BUCKET_CAP_MB * MiB)
    page = render_page("10-many-nodes.md", results, "10", monkeypatch)
    assert "γ from chapter 03: adding at 5 GB/s; measured on" in page


def test_percent_text_agrees_with_the_15_percent_goal():
    assert hook_costmodel.percent_text(-0.15254) == "-15.3%"     # not "-15%" beside "within: none"
    assert hook_costmodel.percent_text(-0.15) == "-15%"          # exactly at the goal: within
    assert hook_costmodel.percent_text(0.150004) == "15.0004%"
    assert hook_costmodel.percent_text(0.1496) == "15%"          # within, and shown as within
    assert hook_costmodel.percent_text(-2.5) == "-250%"


def test_stall_band_above_inside_below_and_without_medians():
    hook = {"measured_ms": 0.0, "compute_ms": 2.0}
    def band(measured, low=1.5, high=3.0):
        return hook_costmodel.stall_band({**hook, "measured_ms": measured}, 6.0, low, high)
    assert (band(5.0)["with_least_stalls_ms"], band(5.0)["with_most_stalls_ms"]) == (8.0, 14.0)
    assert band(20.0)["band_text"].startswith("above the band by 6.0 ms")
    assert band(8.0)["band_text"].startswith("inside the band")       # a bound is inside
    assert band(14.0)["band_text"].startswith("inside the band")
    assert band(1.0)["band_text"].startswith("below the band by 7.0 ms")
    assert hook_costmodel.stall_range({}) == (1.0, 1.0)
    assert hook_costmodel.stall_range(MODEL) == (1.2, 1.5)


def test_prediction_verdict_edges():
    assert hook_costmodel.direction_text([-0.1, 0.0, 0.2]) == (
        "below for 1 hook, above for 1 and exactly at for 1")
    assert hook_costmodel.direction_text([0.0, 0.0]) == (
        "exactly at the measured time for every hook")
    tie = copy.deepcopy(HOOKS)
    predicted = {n: hook_costmodel.predict_hook_ms(h, 2, MODEL) for n, h in tie.items()}
    for name, h in tie.items():     # none and fp16 exactly 50 % too low (a tie), others 75 %
        h["measured_ms"] = (2 if name in ("none", "fp16") else 4) * predicted[name]
    verdict = hook_costmodel.prediction(tie, 2, MODEL)
    assert verdict["least_off"] == "none, fp16"
    assert verdict["least_off_compute_share"] == max(
        verdict["per_hook"][n]["compute_share"] for n in ("none", "fp16"))
    assert hook_costmodel.compute_share_text(0.61).startswith("most of that prediction is measured")
    assert hook_costmodel.compute_share_text(0.39).startswith("most of that prediction is modelled")
    for about_half in (0.4, 0.498, 0.6):  # neither side dominates: the text says so
        assert hook_costmodel.compute_share_text(about_half).startswith("about as much")


def test_chapter09_prediction_and_bits_render_from_results(monkeypatch):
    import chapter09_compression as ch09
    assert ch09.bits_text(0.0) == "the same bits"
    assert ch09.bits_text(2.5e-7) == "not the same bits: they differ by up to 2.5e-07"
    results = json.loads((REPO / "figures/chapter09/results.json").read_text())
    results["equivalence"]["autocast_text"] = ch09.bits_text(1e-3)
    results["prediction"] = hook_costmodel.prediction(
        {**results["hooks"], "powersgd": {**results["hooks"]["powersgd"], "compute_ms": 0.0}},
        2, results["prediction"]["model"])
    page = render_page("09-compression.md", results, "09", monkeypatch)
    assert "steps: not the same bits: they differ by up to 0.001." in page
    share = results["prediction"]["least_off_compute_share"]
    assert f"that compute is\n{share:.0%} of the prediction" in page
    assert results["prediction"]["least_off_compute_text"] in page


def metric(with_ms: float, without_ms: float, call_ms: float) -> dict:
    return {"step_time_ms": {"with": with_ms, "without": without_ms}, "reduce_ms": call_ms}


def test_chapter06_logging_verdict_edges():
    from backstage import chapter06_report
    split = chapter06_report.logging_verdict(metric(5.5, 4.0, 0.5))
    assert (split["gap_ms"], split["rest_ms"], split["call_share_of_gap"]) == (1.5, 1.0,
                                                                               1 / 3)
    assert split["text"].startswith("The steps with it were 1.50 ms (38%) slower; the call "
                                    "itself covers about 33% of that, and the other 1.00 ms")
    over = chapter06_report.logging_verdict(metric(4.2, 4.0, 0.5))   # the call exceeds the gap
    assert "does not split it" in over["text"] and over["rest_ms"] < 0
    for faster in (metric(4.0, 4.0, 0.5), metric(3.0, 4.0, 0.5)):  # a tie, and faster
        verdict = chapter06_report.logging_verdict(faster)
        assert verdict["text"].startswith("The steps with it were not slower here")
        assert verdict["call_share_of_gap"] is None


def test_chapter07_dcp_save_verdict_edges():
    from backstage import chapter07_report
    assert chapter07_report.dcp_save_verdict(55.0, 44.0).startswith(
        "here its save took 1.25 times as long")
    assert chapter07_report.dcp_save_verdict(40.0, 50.0).endswith(
        "0.80 times as long as `torch.save`'s: spreading the writing paid")
    assert chapter07_report.dcp_save_verdict(50.0, 50.0) == (
        "here its save took exactly as long as `torch.save`'s")


def test_pages_06_07_08_render_their_verdicts(monkeypatch):
    r06 = json.loads((REPO / "figures/chapter06/results.json").read_text())
    r06["sync_points"]["metric_reduction"]["verdict"]["text"] = "SENTINEL gap"
    assert "noisy machine). SENTINEL gap." in render_page("06-bubbles.md", r06, "06", monkeypatch)
    r07 = json.loads((REPO / "figures/chapter07/results.json").read_text())
    r07["dcp"]["save_verdict"] = "SENTINEL save"
    assert "its metadata; SENTINEL save." in render_page("07-checkpointing.md", r07, "07",
                                                          monkeypatch)
    r08 = json.loads((REPO / "figures/chapter08/results.json").read_text())
    r08["scenarios"]["port_taken"]["broken"]["port"] = 40404
    page = render_page("08-bug-lab.md", r08, "08", monkeypatch)
    assert "hold port 40404 first" in page and "'sport = :40404'" in page


def test_chapter08_records_the_port_its_error_names():
    from ddplab.bugs import runner
    record = runner.run_in_main(runner.scenario("port_taken"), fixed=False)
    assert f"port: {record['port']}," in record["first_line"]

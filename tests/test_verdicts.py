"""Pages 03 and 05 draw their comparisons from verdicts computed from the run: change a
measured value in a copy of results.json, recompute, render the page, and the sentence follows."""

from __future__ import annotations

import copy
import json
import re
from types import SimpleNamespace

import mkdocs_hooks
import pytest
from collective_workers import chapter02
from conftest import REPO

from backstage import chapter05_report
from backstage.chapter03 import label_bytes, per_call_costs
from backstage.chapter03 import verdicts as ring_verdicts
from backstage.chapter04 import sweep_reading, sweep_verdict

MiB = 2**20
PAGE_03 = (REPO / "docs" / "chapters" / "03-ring-allreduce.md").read_text()
PAGE_05 = (REPO / "docs" / "chapters" / "05-data-parallel.md").read_text()
PAGE_04 = (REPO / "docs" / "chapters" / "04-hooks.md").read_text()
PAGE_02 = (REPO / "docs" / "chapters" / "02-collectives.md").read_text()


def committed(chapter: str) -> dict:
    return json.loads((REPO / "figures" / f"chapter{chapter}" / "results.json").read_text())


@pytest.fixture
def render_page(tmp_path, monkeypatch):
    """Render a page's placeholders against the results given for one chapter."""
    def render(page: str, chapter: str, results: dict) -> str:
        folder = tmp_path / f"chapter{chapter}"
        folder.mkdir(exist_ok=True)
        (folder / "results.json").write_text(json.dumps(results))
        monkeypatch.setattr(mkdocs_hooks, "FIGURES", tmp_path)
        mkdocs_hooks.load_results.cache_clear()
        page_object = SimpleNamespace(file=SimpleNamespace(src_uri="test.md"))
        return " ".join(mkdocs_hooks.on_page_markdown(page, page_object, None, None).split())
    yield render
    mkdocs_hooks.load_results.cache_clear()  # the next test reads the committed figures again


def ring_results(changes: dict | None = None) -> dict:
    """Chapter 03's committed results with some ring / gloo / naive times changed (ms)."""
    m = copy.deepcopy(committed("03"))
    for (name, size), ms in (changes or {}).items():
        m["time_ms"][name][str(size)] = ms
    for s in m["sizes_bytes"]:  # the busbw ratio is gloo's time over the ring's
        m["ratio_ring_to_native_busbw"][str(s)] = (m["time_ms"]["native"][str(s)]
                                                   / m["time_ms"]["ring"][str(s)])
    m["verdicts"] = ring_verdicts(m)
    return m


def sentence(text: str, start: str) -> str:
    return re.search(re.escape(start) + r"[^.]*\.", text).group(0)


def band_results(ring_ms: dict) -> dict:
    """Chapter 03's results with gloo at 1 ms and the ring at the given ms at 1 to 16 MiB."""
    sizes = [MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB]
    return ring_results({("native", s): 1.0 for s in sizes}
                        | {("ring", s): ring_ms.get(s, 1.0) for s in sizes})


def test_where_the_ring_is_slower_than_gloo_follows_the_run(render_page):
    base = band_results({MiB: 2.0, 2 * MiB: 2.0})
    slow = band_results({MiB: 2.0, 2 * MiB: 2.0, 4 * MiB: 2.0})
    before = sentence(render_page(PAGE_03, "03", base), "Compared by bus bandwidth")
    after = sentence(render_page(PAGE_03, "03", slow), "Compared by bus bandwidth")
    assert ("the ring was more than 10 % slower than gloo below 4 MiB, and as fast or faster "
            "from 4 MiB up.") in before
    assert "slower than gloo below 8 MiB, and as fast or faster from 8 MiB up" in after


def test_the_ring_against_gloo_reads_plainly_without_one_threshold():
    level = band_results({})["verdicts"]["ring_against_gloo_in_buckets"]
    behind = band_results({s: 2.0 for s in (MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB)})
    ahead_first = band_results({8 * MiB: 2.0, 16 * MiB: 2.0})
    scattered = band_results({MiB: 2.0, 4 * MiB: 2.0})
    assert level == "the ring was as fast as gloo or faster at every size"
    assert behind["verdicts"]["ring_against_gloo_in_buckets"] == (
        "the ring was more than 10 % slower than gloo at every size")
    assert ahead_first["verdicts"]["ring_against_gloo_in_buckets"] == (
        "the ring was as fast as gloo or faster below 8 MiB, and more than 10 % slower than "
        "gloo from 8 MiB up")
    assert scattered["verdicts"]["ring_against_gloo_in_buckets"] == (
        "the ring was more than 10 % slower than gloo at 1 MiB and 4 MiB, and as fast or "
        "faster at 2 MiB, 8 MiB and 16 MiB")


def test_where_naive_is_fastest_faster_and_slower_follows_the_run(render_page):
    sizes = committed("03")["sizes_bytes"]
    even = {(name, s): 1.0 for s in sizes for name in ("ring", "native")}
    fast = ring_results(even | {("naive", s): 0.5 for s in sizes})
    slow_late = ring_results(even | {("naive", s): 0.5 if s < 2 * MiB else 5.0 for s in sizes})
    v = fast["verdicts"]["naive"]
    assert v["fastest_at"] == sizes and v["slower_at"] == []
    v = slow_late["verdicts"]["naive"]
    assert v["faster_at"] == [s for s in sizes if s < 2 * MiB]
    assert v["slower_at"] == [s for s in sizes if s >= 2 * MiB]
    first = render_page(PAGE_03, "03", fast)
    second = render_page(PAGE_03, "03", slow_late)
    assert f"faster than the ring at 4 KiB to {label_bytes(sizes[-1])} (0.50× its time)" in first
    assert "slower" not in fast["verdicts"]["naive"]["pace_text"]
    assert (f"slower than the ring at 2 MiB to {label_bytes(sizes[-1])} (5.00× its time)"
            in second)
    assert f"fastest of the three at 4 KiB to {label_bytes(sizes[-1])}" in first


def test_a_naive_time_equal_to_the_ring_s_is_a_tie_not_slower(render_page):
    sizes = committed("03")["sizes_bytes"]
    m = ring_results({(name, s): 1.0 for s in sizes for name in ("ring", "native", "naive")})
    v = m["verdicts"]["naive"]
    assert v["tied_at"] == sizes and v["slower_at"] == [] and v["faster_at"] == []
    assert v["fastest_text"] == "was the fastest of the three at no size"
    assert (f"as fast as the ring at 4 KiB to {label_bytes(sizes[-1])} (1.00× its time)"
            in render_page(PAGE_03, "03", m))


def test_page_03_renders_the_run_s_world_size(render_page):
    m = ring_results()
    m["correctness"]["world_size"] = 4
    assert "In this run, at 4 ranks, the naive version" in render_page(PAGE_03, "03", m)


def test_the_ring_alpha_gap_to_naive_follows_the_run_and_claims_no_share(render_page):
    m = ring_results()
    m["alpha_beta"]["naive"]["alpha_us"] = m["alpha_beta"]["ring"]["alpha_us"] - 100.0
    m["verdicts"] = ring_verdicts(m)
    gap = m["verdicts"]["alpha_gap_to_naive"]
    messages = m["per_call"]["messages"]
    assert gap["gap_ms"] == pytest.approx(messages * 0.1)
    assert f"{messages * 0.1:.3f} ms above the naive one's" in gap["text"]
    assert "explains" not in gap["text"] and "This run does not split that" in gap["text"]
    assert gap["text"] in render_page(PAGE_03, "03", m)
    for above in (1.0, 0.0):  # a gap of the other sign, and a tie
        m["alpha_beta"]["naive"]["alpha_us"] = m["alpha_beta"]["ring"]["alpha_us"] + above
        m["verdicts"] = ring_verdicts(m)
        assert "so there is no gap to explain" in render_page(PAGE_03, "03", m)


def test_a_message_dearer_than_an_empty_call_leaves_no_negative_once_per_call_cost(render_page):
    m = ring_results()
    fit = m["alpha_beta"]["ring"]
    world = m["correctness"]["world_size"]
    m["segments"]["extra_ms_per_message"] = fit["alpha_us"] * 1e-3 * 2  # twice one α
    m["per_call"] = per_call_costs(fit, m["segments"], world)
    assert m["per_call"]["once_per_call_ms"] is None and m["per_call"]["rest_ms"] < 0
    m["verdicts"] = ring_verdicts(m)
    page = render_page(PAGE_03, "03", m)
    assert "cost more than the whole empty call" in page and "paid once per call —" not in page
    m["segments"]["extra_ms_per_message"] = None
    m["per_call"] = per_call_costs(fit, m["segments"], world)
    assert "measured no cost per message" in ring_verdicts(m)["once_per_call"]


def test_the_bandwidth_verdict_compares_the_fits_with_what_was_measured(render_page):
    largest = committed("03")["largest"]["size_bytes"]
    for ring_ms, verb in ((1.0, "faster than"), (4.0, "slower than"), (2.0, "as fast as")):
        m = ring_results({("ring", largest): ring_ms, ("native", largest): 2.0})
        m["alpha_beta"]["ring"]["beta_gbps"] = 1.0
        m["alpha_beta"]["native"]["beta_gbps"] = 2.0
        m["verdicts"] = ring_verdicts(m)
        v = m["verdicts"]["bandwidth_gap"]
        assert v["ring_at_largest"] == verb and v["ratio"] == pytest.approx(2.0)
        page = render_page(PAGE_03, "03", m)
        assert "gloo's fitted 1/β is 2.00× the ring's" in page
        assert f"the ring was {verb} gloo" in page
        assert ("the fitted difference is not a measured one" in page) == (verb != "slower than")
        assert "explains" not in v["text"]
    m["alpha_beta"]["native"]["beta_gbps"] = 0.5  # the ring's fit the faster one
    m["verdicts"] = ring_verdicts(m)
    page = render_page(PAGE_03, "03", m)
    assert "the ring's fitted 1/β is 2.00× gloo's" in page
    assert "not a measured one" not in page
    m["alpha_beta"]["native"]["beta_gbps"] = None  # no bandwidth term fitted
    assert "fitted no bandwidth term" in ring_verdicts(m)["bandwidth_gap"]["text"]


def test_the_sizes_where_the_ring_s_busbw_is_below_gloo_s_follow_the_run(render_page):
    sizes = committed("03")["sizes_bytes"]
    even = {(name, s): 1.0 for s in sizes for name in ("ring", "native")}
    m = ring_results(even)
    assert m["verdicts"]["bandwidth_gap"]["below_at"] == []
    page = render_page(PAGE_03, "03", m)
    assert "below gloo's at no size" in page and "does not split the measured gap" not in page
    m = ring_results(even | {("ring", 2 * MiB): 2.0})
    assert m["verdicts"]["bandwidth_gap"]["below_at"] == [2 * MiB]
    assert "below gloo's at 2 MiB (0.50× of it)" in render_page(PAGE_03, "03", m)


def test_the_best_segment_is_judged_against_the_run_s_own_noise(render_page):
    m = ring_results()
    rows = m["segments"]["rows"]
    by_label = {r["segment_label"]: r for r in rows}
    default = by_label[m["segments"]["default_segment"]]
    m["time_ms"]["ring"][str(m["segments"]["size_bytes"])] = default["time_ms"]  # no noise
    m["verdicts"] = ring_verdicts(m)
    assert m["verdicts"]["best_segment"]["noise"] == 0
    assert "are larger than that noise" in render_page(PAGE_03, "03", m)
    m["time_ms"]["ring"][str(m["segments"]["size_bytes"])] = default["time_ms"] * 10  # noisy
    m["verdicts"] = ring_verdicts(m)
    assert "within that noise, so this run does not tell" in render_page(PAGE_03, "03", m)


def test_what_the_size_check_costs_follows_the_run(render_page):
    m = ring_results()
    m.pop("size_check_all_reduce_us", None)  # a run that did not time the check's all-reduce
    m["verdicts"] = ring_verdicts(m)
    assert "did not time the check's own all-reduce alone" in render_page(PAGE_03, "03", m)
    m["size_check_all_reduce_us"] = m["size_check_us"] / 4
    m["verdicts"] = ring_verdicts(m)
    assert "the Python around it" in m["verdicts"]["size_check"]
    assert "(75%)" in render_page(PAGE_03, "03", m)


def test_the_reason_for_the_smallest_alpha_follows_which_alpha_is_smallest(render_page):
    m = ring_results()
    reasons = {"naive": "The simplest one has the smallest fixed cost, and it does the least",
               "native": "gloo, whose whole call runs in C++, has the smallest fixed cost",
               "ring": "The ring has the smallest fixed cost in this run"}
    for smallest, expected in reasons.items():
        for name in reasons:
            m["alpha_beta"][name]["alpha_us"] = 10.0 if name == smallest else 100.0
        m["verdicts"] = ring_verdicts(m)
        page = render_page(PAGE_03, "03", m)
        assert [r for r in reasons.values() if r in page] == [expected]


def test_alpha_sentence_follows_which_alpha_is_smaller(render_page):
    m = ring_results()
    gloo = m["alpha_beta"]["native"]["alpha_us"]
    for naive_alpha, expected in ((10.0, "its α is below gloo's"), (1e4, "no lower than gloo's"),
                                  (gloo, "no lower than gloo's")):
        m["alpha_beta"]["naive"]["alpha_us"] = naive_alpha
        m["verdicts"] = ring_verdicts(m)
        assert expected in render_page(PAGE_03, "03", m)


def dp_results(**why) -> dict:
    r = copy.deepcopy(committed("05"))
    r["why_naive_is_slower"].setdefault("small_allreduce_mean_ms",
                                        r["why_naive_is_slower"]["small_allreduce_ms"])
    r["why_naive_is_slower"].update(why)
    r["verdicts"] = chapter05_report.verdicts(r)
    return r


def test_the_core_says_how_much_of_the_gap_the_named_causes_explain(render_page):
    r = copy.deepcopy(committed("05"))
    t, why = r["step_time_ms"], r["why_naive_is_slower"]
    extra = why["allreduce_calls"]["naive"] - why["allreduce_calls"]["native"]
    for naive_ms, lone_ms, expected in (
            (t["native"] + 100.0, 1.0, "the two explain"),
            (t["native"] + 1.0, 10.0, "the two account for all of NaiveDDP's 1.0 ms gap"),
            (t["native"] - 1.0, 1.0, "NaiveDDP's step was not longer than native DDP's")):
        t["naive"], why["small_allreduce_ms"] = naive_ms, lone_ms
        r["verdicts"] = chapter05_report.verdicts(r)
        gap = r["verdicts"]["gap_to_native"]
        core = render_page(PAGE_05, "05", r).split("**no overlap**. ")[1][:160]
        assert expected in core
        if expected == "the two explain":
            assert f"{gap['explained_ms']:.1f} ms of NaiveDDP's 100.0 ms gap" in core
            assert f"({gap['explained_ms'] / 100.0:.0%})" in core
            assert gap["messages_ms"] == pytest.approx(extra * lone_ms)


def test_the_four_rank_change_takes_its_sign_from_the_run(render_page):
    r = dp_results()
    points = r["scaling"]["points"]
    two = next(p for p in points if p["world_size"] == 2)["samples_per_s"]["native"]
    four = next(p for p in points if p["world_size"] == 4)
    for factor, verb in ((0.5, "4 ranks lose 50% against 2"), (1.25, "4 ranks gain 25% against 2")):
        four["samples_per_s"]["native"] = two * factor
        r["verdicts"] = chapter05_report.verdicts(r)
        assert verb in render_page(PAGE_05, "05", r)


def test_what_the_named_causes_explain_of_the_gap_to_native_follows_the_run(render_page):
    base = dp_results(small_allreduce_ms=0.1, small_allreduce_mean_ms=0.1)
    more = dp_results(small_allreduce_ms=1.0, small_allreduce_mean_ms=1.0)
    why, t = base["why_naive_is_slower"], base["step_time_ms"]
    extra = why["allreduce_calls"]["naive"] - why["allreduce_calls"]["native"]
    gap = base["verdicts"]["gap_to_native"]
    assert gap["gap_ms"] == pytest.approx(t["naive"] - t["native"])
    assert gap["messages_ms"] == pytest.approx(extra * 0.1)
    assert more["verdicts"]["gap_to_native"]["messages_ms"] == pytest.approx(extra * 1.0)
    text = base["verdicts"]["gap_to_native"]["text"]
    assert f"for its {extra} extra messages" in text
    assert text in render_page(PAGE_05, "05", base)
    assert text not in render_page(PAGE_05, "05", more)


def test_a_naive_step_no_longer_than_native_leaves_no_gap_to_explain(render_page):
    r = dp_results()
    r["step_time_ms"]["naive"] = r["step_time_ms"]["native"] - 1.0
    r["verdicts"] = chapter05_report.verdicts(r)
    assert r["verdicts"]["gap_to_native"]["explained_share"] is None
    assert "so there is no gap to explain" in render_page(PAGE_05, "05", r)


def test_scaling_without_communication_is_read_against_the_cores(render_page):
    r = dp_results()
    points = {p["world_size"]: p for p in r["scaling"]["points"]}
    one = points[1]["samples_per_s"]["local"]
    r["scaling"]["cpu_count"], r["scaling"]["threads_per_rank"] = 2, 1
    for two_ranks, expected in ((one * 2, "within 10 % of it"),
                                (one, "50% at 2 ranks")):
        points[2]["samples_per_s"]["local"] = two_ranks
        points[4]["samples_per_s"]["local"] = one * 2
        r["verdicts"] = chapter05_report.verdicts(r)
        row = r["verdicts"]["scaling_without_communication"]["rows"][0]
        assert row["local_speedup"] == pytest.approx(two_ranks / one)
        assert row["allowed"] == 2
        assert expected in render_page(PAGE_05, "05", r)
    r["scaling"]["threads_per_rank"] = None  # one GPU a rank: perfect scaling is the bound
    r["verdicts"] = chapter05_report.verdicts(r)
    assert "one GPU a rank allows 2× and 4×" in render_page(PAGE_05, "05", r)


def test_overlap_verdict_is_a_lower_bound_that_names_the_copies_it_leaves_out(render_page):
    r = dp_results()
    for native_ms, words in ((1e3, "this estimate shows no saving from overlap"),
                             (1e-3, "overlap saved at least")):
        r["step_time_ms"]["native"] = native_ms
        r["verdicts"] = chapter05_report.verdicts(r)
        page = render_page(PAGE_05, "05", r)
        assert words in page and "copies of the gradients into and out of its buckets" in page
        assert ("shows no saving" in page) == (native_ms > 1)
        assert "nothing measurable" not in page


def test_the_overlap_term_of_the_gap_keeps_its_sign(render_page):
    r = dp_results(small_allreduce_ms=0.0, small_allreduce_mean_ms=0.0)  # no message cost
    serial = r["verdicts"]["overlap"]["serial_step_ms"]
    r["step_time_ms"]["native"] = serial + 2.0  # native slower than its serial estimate
    r["step_time_ms"]["naive"] = serial + 10.0
    r["verdicts"] = chapter05_report.verdicts(r)
    gap = r["verdicts"]["gap_to_native"]
    assert gap["below_serial_ms"] == pytest.approx(-2.0)
    assert gap["explained_ms"] == pytest.approx(-2.0)  # not clamped to zero
    page = render_page(PAGE_05, "05", r)
    assert "the two named causes explain none of it (together -2.0 ms)" in page
    assert "-2.0 ms for overlap" in page


def test_the_naive_link_sentence_follows_the_fitted_bandwidths(render_page):
    m = ring_results()
    for naive_gbps, expected in ((1e3, "as if its link were faster"), (1e-3, "no faster than")):
        m["alpha_beta"]["naive"]["beta_gbps"] = naive_gbps
        m["verdicts"] = ring_verdicts(m)
        assert expected in render_page(PAGE_03, "03", m)


def test_what_gloo_s_copies_explain_of_the_flat_reduce_scatter_follows_the_run(render_page):
    ch02 = chapter02()
    r = copy.deepcopy(committed("02"))
    times = {"reduce_scatter_flat": 12.0, "all_reduce": 8.0, ch02.FLAT_COPIES: 1.0}
    r["verdicts"] = {"reduce_scatter_flat": ch02.flat_reduce_scatter_verdict(times, "gloo")}
    page = render_page(PAGE_02, "02", r)
    assert "1.50× as long as the all-reduce of the same tensor, 4.00 ms more" in page
    assert "take 1.00 ms, 25% of that; the other 3.00 ms this run does not attribute" in page
    times[ch02.FLAT_COPIES] = 5.0
    r["verdicts"] = {"reduce_scatter_flat": ch02.flat_reduce_scatter_verdict(times, "gloo")}
    page = render_page(PAGE_02, "02", r)
    assert "take 5.00 ms, more than that excess" in page and "does not attribute" not in page
    assert "100%" not in page.split("take 5.00 ms")[1][:80]
    times[ch02.FLAT_COPIES] = 4.0  # a tie with the excess
    r["verdicts"] = {"reduce_scatter_flat": ch02.flat_reduce_scatter_verdict(times, "gloo")}
    assert "take 4.00 ms, as long as that excess" in render_page(PAGE_02, "02", r)
    times["reduce_scatter_flat"] = 7.0  # no longer than the all-reduce: nothing to explain
    r["verdicts"] = {"reduce_scatter_flat": ch02.flat_reduce_scatter_verdict(times, "gloo")}
    assert "0.88× as long as the all-reduce of the same tensor, no longer than it" in \
        render_page(PAGE_02, "02", r)


def sweep_point(cap: float, buckets: int, ms: float) -> dict:
    return {"bucket_cap_mb": cap, "step_time_ms": {"bucketed": ms, "native": ms},
            "buckets": {"bucketed": buckets, "native": buckets}}


def test_the_bucket_sweep_is_read_against_its_own_noise(render_page):
    r = copy.deepcopy(committed("04"))
    many = [sweep_point(0.25, 9, 40.0), sweep_point(0.5, 9, 41.0)]  # 1 ms of noise
    one = [sweep_point(16, 1, 30.0), sweep_point(32, 1, 30.5)]
    for middle_ms, many_words, one_words in (
            (30.2, "slower than every other cap, by at least 9.5 ms",
             "not apart from every cap in between by more than that noise"),
            (35.0, "slower than every other cap, by at least 5.0 ms",
             "faster than every cap in between, by at least 4.5 ms"),
            (20.0, "slower than every other cap, by at least 9.5 ms",
             "slower than every cap in between, by at least 10.0 ms")):
        points = [*many, sweep_point(4, 3, middle_ms), *one]
        r["bucket_sweep"]["verdict"] = {kind: sweep_verdict(points, kind)
                                        for kind in ("bucketed", "native")}
        r["bucket_sweep"]["reading"] = sweep_reading(r["bucket_sweep"]["verdict"])
        page = render_page(PAGE_04, "04", r)
        assert "spread by up to 1.0 ms, the sweep's own noise" in page
        most = "the steps with the most buckets (9, caps 0.25 to 0.5 MiB) were "
        assert most + many_words in page
        assert f"those with the fewest (1, caps 16 to 32 MiB) were {one_words}" in page


def sweep_page(render_page, points: list[dict], native_points: list[dict] | None = None) -> str:
    r = copy.deepcopy(committed("04"))
    r["bucket_sweep"]["verdict"] = {"bucketed": sweep_verdict(points, "bucketed"),
                                    "native": sweep_verdict(native_points or points, "native")}
    r["bucket_sweep"]["reading"] = sweep_reading(r["bucket_sweep"]["verdict"])
    return render_page(PAGE_04, "04", r)


def test_the_bucket_sweep_s_plain_reading_follows_the_run(render_page):
    many = [sweep_point(0.25, 9, 40.0), sweep_point(0.5, 9, 41.0)]  # 1 ms of noise
    one = [sweep_point(16, 1, 40.2), sweep_point(32, 1, 40.7)]
    flat = sweep_page(render_page, [*many, sweep_point(4, 3, 40.5), *one])
    assert ("For both DDPs, no bucket cap was measurably faster than another: the spread "
            "between caps, 1.0 ms, was within the sweep's own noise (1.0 ms for BucketedDDP, "
            "1.0 ms for native DDP).") in flat
    ends = sweep_page(render_page, [*many, sweep_point(4, 3, 39.6), *one])
    assert ("neither the smallest caps (9 buckets) nor the largest (1 bucket) were measurably "
            "slower or faster than the other caps") in ends
    slow_small = [*many, sweep_point(4, 3, 30.2), sweep_point(16, 1, 30.0),
                  sweep_point(32, 1, 30.5)]
    page = sweep_page(render_page, slow_small)
    assert ("For both DDPs, the smallest caps (9 buckets) were slower than the other caps by "
            "more than the sweep's own noise (1.0 ms for BucketedDDP") in page
    page = sweep_page(render_page, slow_small, native_points=[*many, sweep_point(4, 3, 40.5), *one])
    assert ("For BucketedDDP, the smallest caps (9 buckets) were slower than the other caps by "
            "more than the sweep's own noise (1.0 ms); for native DDP, no bucket cap was "
            "measurably faster than another") in page


def test_a_bucket_sweep_without_repeated_layouts_claims_no_reading():
    points = [sweep_point(1, 3, 30.0), sweep_point(4, 2, 50.0), sweep_point(16, 1, 31.0)]
    v = sweep_verdict(points, "bucketed")
    assert v["noise_ms"] is None and "does not read its curve" in v["text"]
    same = sweep_verdict([sweep_point(16, 1, 30.0), sweep_point(32, 1, 33.0)], "bucketed")
    assert same["noise_ms"] == pytest.approx(3.0) and "every cap made the same buckets" in \
        same["text"]
    two_ends = sweep_verdict([sweep_point(1, 3, 30.0), sweep_point(2, 3, 30.1),
                              sweep_point(16, 1, 29.0)], "bucketed")
    assert "cap in between" not in two_ends["text"]  # no middle: one comparison, not two
    assert "slower than every other cap, by at least 1.0 ms" in two_ends["text"]


def test_the_gap_accounting_handles_causes_beyond_the_gap_and_a_run_without_stall_times():
    r = dp_results(small_allreduce_ms=100.0, small_allreduce_mean_ms=100.0)
    text = r["verdicts"]["gap_to_native"]["text"]
    assert "account for all of it and more" in text and "%)" not in text.split(":")[0]
    r = dp_results()
    del r["why_naive_is_slower"]["small_allreduce_mean_ms"]
    gap = chapter05_report.verdicts(r)["gap_to_native"]
    assert gap["stalls_ms"] is None and "did not time the stalls" in gap["text"]

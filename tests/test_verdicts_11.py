"""Chapter 11's page says what its numbers say: change a value in a copy of results.json,
recompute the verdicts, render the page, and the sentence follows."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import mkdocs_hooks
import pytest
from conftest import REPO

from backstage import chapter11_report

PAGE = "11-sharding.md"
EQUALITY_KEYS = ("zero1_ours_vs_zero_redundancy", "zero1_ours_vs_ddp", "zero2_ours_vs_ddp",
                 "fsdp_ours_vs_fully_shard", "fully_shard_vs_ddp", "flat_layout_vs_fully_shard")


@pytest.fixture
def results() -> dict:
    """The committed run, with made-up values for any key a newer run adds."""
    r = copy.deepcopy(json.loads((REPO / "figures" / "chapter11" / "results.json").read_text()))
    r.setdefault("equality_3", {
        "steps": 3, "world_size": 3,
        "max_abs_diff": {k: 0.0 for k in EQUALITY_KEYS} | {
            "fully_shard_vs_ddp": 2e-7, "flat_layout_vs_fully_shard": 1e-7},
        "first_difference": {"element": "0.weight[8, 2]", "owner": 2, "shard_major_offset": 66,
                             "parameter_major_offset": 58, "message_numel": 96,
                             "fully_shard": 0.25, "flat_layout": 0.2500001}})
    for mode in ("every_micro_batch", "once_per_step"):
        acc = r["accumulation"][mode]
        acc.setdefault("bytes_per_step", acc.pop("bytes", None))
    r["accumulation"]["clipping"].setdefault("grads_max_abs_diff", 0.0)
    return r


def rendered(results: dict, monkeypatch) -> str:
    """The page with its placeholders filled from ``results`` and verdicts recomputed."""
    results = copy.deepcopy(results)
    results["verdicts"] = chapter11_report.verdicts(results, "gloo")
    real = mkdocs_hooks.load_results
    monkeypatch.setattr(mkdocs_hooks, "load_results",
                        lambda ch: results if ch == "11" else real(ch))
    markdown = (REPO / "docs" / "chapters" / PAGE).read_text()
    return mkdocs_hooks.on_page_markdown(markdown, SimpleNamespace(
        file=SimpleNamespace(src_uri=PAGE)), None, None)


def test_every_placeholder_renders(results, monkeypatch):
    page = " ".join(rendered(results, monkeypatch).split())
    assert "{{" not in page
    first = results["equality_3"]["first_difference"]
    assert (f"`{first['element']}`, owned by rank {first['owner']}: offset "
            f"{first['shard_major_offset']:,} of its layer's {first['message_numel']:,}-element "
            f"shard-major message, {first['parameter_major_offset']:,} of the parameter-major"
            in page)


@pytest.mark.parametrize("held", [1.5, 2.0, 2.9])
def test_the_held_ratio_is_rendered_and_no_gloo_peak_is_compared(results, monkeypatch, held):
    acc = results["accumulation"]
    acc["once_per_step"]["gradients_held"] = int(held * acc["every_micro_batch"]["gradients_held"])
    page = " ".join(rendered(results, monkeypatch).split())
    assert f"for this rank's shards: {held:.2f} times" in page
    assert "peaked at" not in page.split("## Gradient accumulation")[1].split("## ")[0]


def test_three_rank_column_follows_the_numbers(results, monkeypatch):
    results["equality_3"]["max_abs_diff"]["flat_layout_vs_fully_shard"] = 0.0
    results["equality_3"]["max_abs_diff"]["fsdp_ours_vs_fully_shard"] = 3e-8
    v = chapter11_report.verdicts(results, "gloo")
    assert v["equal_3"]["flat_layout_vs_fully_shard"] == "bitwise equal"
    assert v["equal_3"]["fsdp_ours_vs_fully_shard"] == "apart by up to 3e-08"
    assert "| 3e-08 | apart by up to 3e-08 |" in rendered(results, monkeypatch)


def test_no_three_rank_verdicts_without_the_three_rank_run(results):
    del results["equality_3"]  # under torchrun
    assert "equal_3" not in chapter11_report.verdicts(results, "gloo")


def test_typed_comparisons_are_computed(results, monkeypatch):
    v = chapter11_report.verdicts(results, "gloo")
    assert v["ledger_all_exact_text"] == "every bar equals its formula to the byte"
    assert v["zero1_alike_text"] == "with `ZeroRedundancyOptimizer` and with ours alike"
    assert v["fsdp_ours_sends_text"] == "the same calls and message bytes"
    assert v["accumulate_native_text"]["once_per_step"] == "bitwise equal"
    assert v["clip_grads_text"].endswith("over the same, bitwise-equal, gradients")
    assert [round(gb, 1) for gb in v["paper_total_gb"]] == [120.0, 31.4, 16.6, 1.9]

    rank0 = results["ledger"]["per_rank"][0]
    rank0["zero1_ours"]["held"]["optimizer_state"] += 8
    rank0["fsdp_ours"]["held"]["grads"] += 4
    results["communication"]["measured"]["fsdp_ours"]["calls"] += 1
    results["accumulation"]["once_per_step"]["ours_vs_fully_shard"] = 1e-7
    results["accumulation"]["clipping"]["grads_max_abs_diff"] = 2e-7
    v = chapter11_report.verdicts(results, "gloo")
    assert v["ledger_all_exact_text"].startswith("not every bar")
    assert v["zero1_alike_text"].endswith("ours holds other bytes")
    assert v["fsdp_ours_sends_text"].startswith(
        f"{results['communication']['measured']['fsdp_ours']['calls']} calls")
    assert v["accumulate_native_text"]["once_per_step"] == "apart by up to 1e-07"
    assert v["clip_grads_text"].startswith("the gradients themselves differ by up to 2e-07")
    page = " ".join(rendered(results, monkeypatch).split())
    assert "reducing once apart by up to 1e-07" in page


def test_ring_halves_ratios_per_size(results):
    row = results["communication"]["ring_halves"]["sizes"][0]
    results["communication"]["ring_halves"]["sizes"] = [
        copy.deepcopy(row) | {"bytes": mib * 2**20, "median_ms": row["median_ms"] | {
            "gloo_all_reduce": 2.0, "gloo_reduce_scatter": 2.0 * ratio}}
        for mib, ratio in ((1, 1.5), (4, 0.75), (16, 1.25))]
    text = chapter11_report.verdicts(results, "gloo")["gloo_rs_over_all_reduce_text"]
    assert text == "1.50 times at 1 MiB, 0.75 at 4 MiB and 1.25 at 16 MiB"
    results["equality"]["world_size"] = 3
    assert chapter11_report.verdicts(results, "gloo")["halves_order_note"] == ""

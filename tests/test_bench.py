"""make bench's table: wall times read from results.json, slow chapters flagged (no timing here:
the results.json files are made up)."""

from __future__ import annotations

import json
from pathlib import Path

import bench


def fake_run(out: Path, chapter: int, seconds) -> Path:
    script = Path(f"scripts/chapter{chapter:02d}_demo.py")
    (out / f"chapter{chapter:02d}").mkdir(parents=True)
    payload = {"chapter": chapter, "provenance": {}}
    if seconds is not None:
        payload["seconds"] = seconds
    (out / f"chapter{chapter:02d}" / "results.json").write_text(json.dumps(payload))
    return script


def test_slow_chapters_are_flagged_and_the_exit_status_stays_0(tmp_path):
    rows = [bench.read_row(tmp_path, fake_run(tmp_path, 1, 12.5)),
            bench.read_row(tmp_path, fake_run(tmp_path, 2, 61.0))]
    text = bench.table(rows, limit=60)
    lines = text.splitlines()
    assert "12.5 s" in lines[1] and "SLOW" not in lines[1]
    assert "61.0 s" in lines[2] and "SLOW: over 60 s" in lines[2]
    assert "1 chapter(s) over 60 s" in lines[-1] and "exit status stays 0" in lines[-1]
    assert bench.exit_status(rows) == 0


def test_exactly_at_the_limit_is_not_flagged(tmp_path):
    rows = [bench.read_row(tmp_path, fake_run(tmp_path, 3, 60.0))]
    assert "SLOW" not in bench.table(rows, limit=60)
    assert bench.table(rows, limit=60).splitlines()[-1] == "all 1 chapters within 60 s"


def test_a_failed_run_or_a_missing_time_fails_the_bench(tmp_path):
    failed = bench.read_row(tmp_path, Path("scripts/chapter04_x.py"), 1, "boom\nerror: no port\n")
    no_time = bench.read_row(tmp_path, fake_run(tmp_path, 5, None))
    missing = bench.read_row(tmp_path, Path("scripts/chapter06_x.py"))
    assert failed.error == "exit 1: error: no port"
    assert no_time.error == "results.json has no 'seconds'"
    assert missing.error.startswith("no results.json")
    text = bench.table([failed, no_time, missing])
    assert text.count("FAILED") == 3 and text.splitlines()[-1].startswith("3 chapter(s) failed")
    assert bench.exit_status([failed]) == 1


def test_every_chapter_script_is_found_with_its_number():
    scripts = bench.chapter_scripts()
    numbers = [bench.chapter_number(s) for s in scripts]
    assert numbers == sorted(numbers) and 3 in numbers


def test_record_writes_the_times_the_workshop_guide_reads(tmp_path):
    rows = [bench.Row(1, "chapter01_processes.py", 12.5), bench.Row(5, "chapter05_x.py", 48.0)]
    path = bench.record(rows, {"01": 3.5, "05": 9.0}, root=tmp_path)
    recorded = json.loads(path.read_text())
    assert path == tmp_path / "figures" / "bench" / "results.json"
    assert recorded["quick_seconds"] == {"01": 12.5, "05": 48.0}
    assert recorded["quick_seconds_max"] == 48.0 and recorded["grading_seconds_max"] == 9.0
    assert recorded["provenance"]["quick"] is True and recorded["provenance"]["git_commit"]


def test_chapter06_timing_relations_are_read_and_flagged(tmp_path):
    straggler = {"slope_idle": 1.3, "slope_step_time": 1.0, "idle_ms_fast_ranks": [1.0, 40.0],
                 "idle_ms_slow_rank": [1.0, 4.0],
                 "bucketed": {"slope_idle": 0.9, "idle_ms_fast_ranks": [2.0, 41.0],
                              "wait_span_ms_fast_ranks": [1.0, 40.5]}}
    (tmp_path / "chapter06").mkdir()
    (tmp_path / "chapter06" / "results.json").write_text(json.dumps({"straggler": straggler}))
    relations = bench.straggler_relations(tmp_path)
    assert relations == {"slope_idle_native": 1.3, "slope_idle_bucketed": 0.9,
                         "slope_step_time_native": 1.0, "late_rank_idle_share": 0.1,
                         "bucketed_wait_gap_ms": 1.0}
    flagged = [line for line in bench.relations_table(relations).splitlines() if "OFF" in line]
    assert len(flagged) == 1 and "slope_idle_native" in flagged[0]
    assert "outside 0.8..1.2" in flagged[0]
    assert bench.straggler_relations(tmp_path / "none") == {}


def test_chapter11s_goals_are_judged_from_the_measured_ratios():
    found = {"fsdp_step_ratio": 0.97, "zero1_step_ratio": 1.4, "peak_ratio_per_rank": [0.9, 1.3],
             "fake_group_peak_bytes": {"fsdp_ours": [110, 110], "fully_shard": [100, 100]}}
    goals = bench.sharding_goals(found)
    assert goals["fsdp_step_ratio"]["text"] == "met"
    assert goals["peak_ratio"] == {"value": 1.1, "goal": 1.0, "met": False, "text": "missed"}
    assert goals["peak_ratio_gloo"] == {"value": 1.3, "goal": None, "met": None, "text": "no goal"}
    assert goals["zero1_step_ratio"]["met"] is None  # measured and shown, not judged
    assert "OFF: goal <= 1" in bench.sharding_table(found)
    assert "fsdp_step_ratio" in bench.sharding_table(found).splitlines()[0]


def test_chapter11s_step_ratios_are_also_recorded_as_ratios_of_medians():
    found = {"median_step_ms": {"fsdp_ours": 30.0, "fully_shard": 20.0,
                                "zero1_ours": 10.0, "zero1_native": 8.0}}
    assert bench.ratios_of_medians(found) == {"fsdp_step_ratio": 1.5, "zero1_step_ratio": 1.25}

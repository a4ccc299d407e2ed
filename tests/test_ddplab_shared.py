"""The shared pieces: results.json, staged output, timing, timelines, plotting."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch
from conftest import assert_png

from ddplab.run import plotting, results, timing
from ddplab.run.ranks import RankContext
from ddplab.run.timeline import Event, Timeline, chrome_trace, draw_gantt


def cpu_context(**overrides) -> RankContext:
    fields = {"rank": 0, "local_rank": 0, "world_size": 2, "backend": "gloo",
              "device": torch.device("cpu"), "seed": 0, "quick": True, "launcher": "mp.spawn"}
    return RankContext(**{**fields, **overrides})


def test_provenance_says_where_a_number_came_from():
    p = results.provenance(cpu_context())
    assert p["torch"] == torch.__version__
    assert p["backend"] == "gloo"
    assert p["world_size"] == 2
    assert p["quick"] is True
    assert p["device"] and p["device"] != "cpu"  # the CPU model, not just "cpu"
    assert p["git_commit"]


def test_git_commit_is_dirty_for_code_changes_not_for_regenerated_figures(tmp_path, monkeypatch):
    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "results.json").write_text("{}")
    (tmp_path / "script.py").write_text("print(1)")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "start")
    monkeypatch.setattr(results, "REPO_ROOT", tmp_path)
    clean = results.git_commit()
    assert len(clean) == 12 and not clean.endswith("+dirty")
    (tmp_path / "figures" / "results.json").write_text('{"new": 1}')  # make figures did this
    assert results.git_commit() == clean
    (tmp_path / "script.py").write_text("print(2)")  # the code changed: say so
    assert results.git_commit() == clean + "+dirty"


def test_results_json_has_chapter_provenance_and_metrics(tmp_path):
    path = results.write_results(tmp_path, 5, {"a": {"b": 1.5}, "bad": float("nan")}, {"x": 1})
    data = json.loads(path.read_text())  # strict JSON: NaN became null
    assert 0 < data.pop("seconds") < time.time() - results.process_start() + 1  # wall time
    assert data == {"chapter": 5, "provenance": {"x": 1}, "a": {"b": 1.5}, "bad": None}


def test_chapter_output_moves_files_only_on_success(tmp_path):
    with results.chapter_output(tmp_path, 3) as staging:
        (staging / "a.txt").write_text("new")
    assert (tmp_path / "chapter03" / "a.txt").read_text() == "new"

    with pytest.raises(RuntimeError), results.chapter_output(tmp_path, 3) as staging:
        (staging / "a.txt").write_text("half-written")
        raise RuntimeError("plotting failed")
    assert (tmp_path / "chapter03" / "a.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chapter03"]  # no staging left


def test_time_steps_skips_warmup_and_returns_milliseconds():
    calls = []
    samples = timing.time_steps(lambda: calls.append(1), steps=5, warmup=3)
    assert len(calls) == 8
    assert len(samples) == 5
    assert all(0 <= s < 100 for s in samples)


def test_compare_interleaves_variants():
    order = []
    samples = timing.compare({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                             rounds=3, warmup=1)
    assert order == ["a", "b"] + ["a", "b"] * 3
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3}
    assert timing.median([3.0, 1.0, 2.0]) == 2.0


def test_timeline_spans_and_chrome_trace():
    tl = Timeline(rank=1)
    with tl.span("forward", "forward"):
        pass
    tl.add("bucket 0", "comm", 1.0, 3.0, bytes=64)
    trace = chrome_trace(tl.events)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["forward", "bucket 0"]
    assert spans[1]["ts"] == 1000.0 and spans[1]["dur"] == 2000.0  # microseconds
    assert all(e["pid"] == 1 for e in trace["traceEvents"])
    json.dumps(trace)


def test_gantt_and_style_produce_a_png(tmp_path):
    events = [Event("fwd", "forward", 0, 2, 0), Event("ar", "comm", 2, 5, 0),
              Event("fwd", "forward", 0, 3, 1), Event("ar", "comm", 3, 5, 1)]
    fig, ax = plotting.figure(height=2.5)
    draw_gantt(ax, events, lanes=["comm"], title="two ranks")
    assert_png(plotting.save(fig, tmp_path / "gantt.png"))

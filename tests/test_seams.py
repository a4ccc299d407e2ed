"""The public seams: BucketedDDP's observer and use_layout, the one chapter main (run_chapter),
cli.with_changes and the one max over ranks.  One in-process rank; no chapter is run."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn

from ddplab import BucketedDDP
from ddplab.bucketed_ddp import BucketObserver, assign_buckets
from ddplab.run.chapter_main import every_file, figures_only, run_chapter, the_folder
from ddplab.run.cli import with_changes
from ddplab.run.launch import Run
from ddplab.run.ranks import max_over_ranks


class Recorder(BucketObserver):
    def __init__(self):
        self.events = []

    def bucket_launching(self, bucket):
        self.events.append(("launching", bucket.index, bucket.work is None))

    def bucket_launched(self, bucket):
        self.events.append(("launched", bucket.index, bucket.work is None))

    def backward_finishing(self):
        self.events.append(("finishing",))

    def backward_finished(self):
        self.events.append(("finished",))


def two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def one_step(ddp: BucketedDDP) -> None:
    ddp(torch.randn(8, 64)).sum().backward()


def force_one_bucket_per_parameter(ddp: BucketedDDP) -> list[list[str]]:
    ddp.use_layout([[named] for named in reversed(ddp.params)], keep=True)
    return [bucket.names for bucket in ddp.buckets]


@pytest.mark.parametrize("overlap", [True, False])
def test_the_observer_hears_every_launch_then_the_end_of_backward(one_rank, overlap):
    seen = Recorder()
    ddp = BucketedDDP(two_layers(), bucket_cap_mb=1e-9, overlap=overlap, observer=seen)
    force_one_bucket_per_parameter(ddp)
    one_step(ddp)
    launches = [e for e in seen.events if e[0] != "finishing" and e[0] != "finished"]
    assert launches == [(kind, i, kind == "launching") for i in range(4)
                        for kind in ("launching", "launched")]  # work set between the two
    finishing, finished = seen.events.index(("finishing",)), seen.events.index(("finished",))
    assert finished == len(seen.events) - 1
    # with overlap the buckets go out during backward; without, all of them after it
    assert (finishing == len(launches)) if overlap else (finishing == 0)


def test_without_an_observer_nothing_is_reported_and_training_works(one_rank):
    ddp = BucketedDDP(two_layers())
    assert type(ddp.observer) is BucketObserver  # the silent default
    one_step(ddp)
    assert all(p.grad is not None for p in ddp.module.parameters())


def test_a_kept_layout_is_never_rebuilt_and_an_initial_one_is(one_rank):
    kept = BucketedDDP(two_layers(), bucket_cap_mb=1e-9)
    kept.use_layout([[named] for named in kept.params], keep=True)  # definition order
    rebuilt = BucketedDDP(two_layers(), bucket_cap_mb=1e-9)
    rebuilt.use_layout([[named] for named in rebuilt.params])  # the same, not kept
    for _ in range(3):
        one_step(kept)
        one_step(rebuilt)
    in_definition_order = [[name] for name, _ in kept.params]
    assert [bucket.names for bucket in kept.buckets] == in_definition_order
    # the gradients arrive in reverse: the rebuild reorders what was not kept
    assert [bucket.names for bucket in rebuilt.buckets] == in_definition_order[::-1]


def test_use_layout_accepts_the_packing_rules_groups(one_rank):
    ddp = BucketedDDP(two_layers(), bucket_cap_mb=0.001)
    groups = assign_buckets(ddp.params, ddp.caps[1])
    ddp.use_layout(groups, keep=True)
    assert [b.names for b in ddp.buckets] == [[n for n, _ in g] for g in groups]


def test_max_over_ranks_keeps_the_kind_it_was_given(one_rank):
    assert max_over_ranks(2.5) == 2.5
    out = max_over_ranks(torch.tensor([[1.0, 3.0]], dtype=torch.float64))
    assert out.dtype == torch.float64 and out.tolist() == [[1.0, 3.0]]


def test_with_changes_copies_and_leaves_the_flags_alone():
    args = argparse.Namespace(world_size=2, quick=True)
    sub = with_changes(args, world_size=3, stage="crash")
    assert vars(sub) == {"world_size": 3, "quick": True, "stage": "crash"}
    assert vars(args) == {"world_size": 2, "quick": True}


def draw_one(results: dict, folder) -> list[str]:
    (folder / "one.png").write_bytes(b"png")
    return ["one.png"]


def chapter_args(tmp_path, **flags) -> argparse.Namespace:
    return argparse.Namespace(out=tmp_path / "out", replot=False, **flags)


def test_run_chapter_writes_one_set_and_prints_the_summary_then_what_it_wrote(tmp_path, capsys):
    run = Run(result={"x": 1}, provenance={"world_size": 1})
    calls = []

    def extras(folder, metrics, given):
        calls.append(("extras", metrics, given))
        (folder / "data.json").write_text("{}")
        return ["data.json"]

    metrics = run_chapter(42, chapter_args(tmp_path), start=lambda args: run,
                          finish=lambda args, given: {"y": given.result["x"] + 1},
                          extras=extras, draw=draw_one,
                          summarize=lambda m, given: f"summary y={m['y']}")
    folder = tmp_path / "out" / "chapter42"
    assert metrics == {"y": 2}
    assert calls == [("extras", {"y": 2}, run)]
    assert sorted(p.name for p in folder.iterdir()) == ["data.json", "one.png", "results.json"]
    assert json.loads((folder / "results.json").read_text())["y"] == 2
    assert capsys.readouterr().out.splitlines() == [
        "summary y=2", f"wrote {folder}/{{one.png, data.json, results.json}}"]


def test_run_chapter_writes_nothing_where_no_run_came_back(tmp_path, capsys):
    assert run_chapter(42, chapter_args(tmp_path), start=lambda args: None,
                       finish=pytest.fail, draw=draw_one, summarize=pytest.fail) is None
    assert not (tmp_path / "out").exists() and capsys.readouterr().out == ""


def test_the_closing_lines():
    folder, figures, extras = "out/chapter07", ["a.png"], ["b.json"]
    assert (every_file(folder, figures, extras)
            == "wrote out/chapter07/{a.png, b.json, results.json}")
    assert figures_only(folder, figures, extras) == "wrote out/chapter07/{a.png, results.json}"
    assert the_folder(folder, figures, extras) == "wrote out/chapter07/"

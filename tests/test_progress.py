"""ddplab.progress: a bar on a terminal, a few plain lines in a log, nothing on other ranks."""

from __future__ import annotations

import io

import pytest
import torch

import ddplab
from ddplab.run import ranks


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def context(rank: int) -> ddplab.RankContext:
    return ddplab.RankContext(rank=rank, local_rank=rank, world_size=2, backend="gloo",
                              device=torch.device("cpu"), seed=0, quick=True, launcher="mp.spawn")


def test_a_log_gets_a_line_every_ten_percent_not_a_carriage_return_per_item():
    log = io.StringIO()
    items = list(ddplab.progress(range(1000), context(0), "steps", stream=log))
    assert items == list(range(1000))
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert len(lines) == 10, lines  # 10 %, 20 %, ... 100 %
    assert lines[0].startswith("steps: 100/1000 (10 %)")
    assert lines[-1].startswith("steps: 1000/1000 (100 %)")


def test_a_log_also_gets_a_line_every_few_seconds(monkeypatch):
    clock = iter(range(0, 10_000, 4))  # each item takes 4 s: a line every 10 s, i.e. every 3rd
    monkeypatch.setattr(ranks.time, "monotonic", lambda: next(clock))
    log = io.StringIO()
    list(ddplab.progress(iter(range(9)), context(0), "sweep", stream=log))  # length unknown
    assert log.getvalue().splitlines() == ["sweep: 3, 12 s", "sweep: 6, 24 s", "sweep: 9, 36 s"]


def test_an_unknown_length_ends_with_a_line_saying_where_it_ended():
    log = io.StringIO()
    list(ddplab.progress(iter(range(5)), context(0), "batches", stream=log))
    assert log.getvalue().splitlines()[-1].startswith("batches: 5 done")


def test_a_terminal_gets_a_tqdm_bar():
    tty = Terminal()
    list(ddplab.progress(range(50), context(0), "steps", stream=tty))
    assert "\r" in tty.getvalue() and "steps" in tty.getvalue()


@pytest.mark.parametrize("stream", [io.StringIO(), Terminal()])
def test_other_ranks_print_nothing(stream):
    items = range(10)
    assert ddplab.progress(items, context(1), "steps", stream=stream) is items
    assert stream.getvalue() == ""

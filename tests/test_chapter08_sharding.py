"""The bug lab's sharding failures, each met on its own as a reader would (`--bug NAME`): what
the symptom says, and that no process of the run is left.

The whole lab's quick run (tests/test_chapter08.py) checks that every broken version shows its
catalogued symptom and every fix runs clean; these check what the page explains about each.
"""

from __future__ import annotations

import re

import pytest
from test_chapter08 import run_in_own_group

NORMS = re.compile(r"clipped by the norms ([\d.]+), ([\d.]+) per rank; the model's gradient "
                   r"norm is ([\d.]+)")


def bug(*argv: str) -> str:
    proc, out, err, left = run_in_own_group("--bug", *argv)
    assert proc.returncode == 0, err[-3000:]
    assert left == [], f"still running after the bug: {left}"
    return out


@pytest.mark.slow
def test_a_forward_on_rank_0_only_hangs_until_the_timeout():
    out = bug("skipped_gather")
    ranks = [line for line in out.splitlines() if line.startswith("[rank ")]
    # Both ranks wait, rank 0 in the gather and rank 1 in the barrier; whichever gives up first
    # says so, and the other sees its connection closed.
    assert len(ranks) == 2 and any("Timed out waiting" in line for line in ranks), ranks
    assert "validation loss" not in out  # rank 0 never got through its forward
    assert "skipped_gather (broken, hang)" in out and "reproduced" in out


@pytest.mark.slow
def test_rank_0s_state_dict_holds_half_the_rows_of_every_weight():
    out = bug("save_one_rank")
    # mlp(): Linear(8, 16) and Linear(16, 4); at 2 ranks rank 0 holds rows 0-7 and 0-1
    assert ("size mismatch for 0.weight: copying a param with shape torch.Size([8, 8]) from "
            "checkpoint, the shape in current model is torch.Size([16, 8])") in out
    assert "torch.Size([2, 16]) from checkpoint" in out


@pytest.mark.slow
def test_clipping_uses_each_shards_norm_broken_and_the_models_norm_fixed():
    broken = [float(n) for n in NORMS.search(bug("local_norm_clip")).groups()]
    *per_rank, model = broken
    assert per_rank[0] != per_rank[1]
    assert all(n < model for n in per_rank)  # a shard's norm is part of the whole's
    # the squares of the shards' norms add up to the square of the model's (to the printed 4
    # significant digits)
    assert sum(n * n for n in per_rank) == pytest.approx(model * model, rel=2e-3)
    out = bug("local_norm_clip", "--fixed")
    *per_rank, model = [float(n) for n in NORMS.search(out).groups()]
    assert per_rank == [model, model]
    assert "local_norm_clip (fixed): ran clean" in out

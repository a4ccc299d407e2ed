"""The textbook ring that chapter 03 lists (two loops of send/recv) gives dist.all_reduce's sums
and, bit for bit, ring_all_reduce's: the fast relay is the same algorithm."""

from __future__ import annotations

import pytest
import textbook_ring_workers
from test_ring import parse

import ddplab


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_textbook_ring_matches_dist_all_reduce_and_the_relay(world_size, tmp_path):
    run = ddplab.launch(textbook_ring_workers.textbook_matrix,
                        parse("--world-size", str(world_size), out=tmp_path))
    assert run.result == []

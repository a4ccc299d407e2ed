"""Chapter 04's teaching core (ddplab.hooked_buckets) averages gradients as native DDP does."""

from __future__ import annotations

import collective_workers
import pytest
from conftest import launch_forked
from torch import nn

import ddplab
from ddplab.hooked_buckets import reverse_order_buckets


def test_buckets_are_packed_last_parameter_first_under_the_cap():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))  # weight 400 + bias 40 bytes
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}

    def layout(cap_bytes):
        return [[index[id(p)] for p in b] for b in reverse_order_buckets(params, cap_bytes)]

    assert layout(440) == [[3, 2], [1, 0]]  # bias 40 + weight 400 bytes fill one
    assert layout(1) == [[3], [2], [1], [0]]
    assert layout(10**6) == [[3, 2, 1, 0]]


@pytest.mark.parametrize("world_size", [2, 3])
def test_hooked_buckets_average_like_native_ddp(world_size, tmp_path):
    args = ddplab.parse_chapter_args(ddplab.chapter_parser("test"),
                                     ["--world-size", str(world_size), "--out", str(tmp_path)])
    ranks = launch_forked(collective_workers.hooked_buckets_vs_native, args).result
    for r in ranks:
        assert r["buckets"] >= 3
        assert r["first_bucket_is_last_layer"]
        assert r["launch_logs"] == [list(range(r["buckets"]))] * 2  # index order, every pass
        if world_size == 2:  # a + b == b + a: the bucket layout cannot change a bit
            assert r["max_abs_diff"] == 0.0
        else:  # three summands: the order gloo adds them in depends on the offset in the message
            assert r["max_abs_diff"] <= 1e-6 * r["max_abs"]

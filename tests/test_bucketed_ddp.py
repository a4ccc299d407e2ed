"""BucketedDDP against native DistributedDataParallel, on gloo CPU ranks.

With 2 ranks the results must be bit-for-bit equal (every element is a/2 + b/2 in both, and
addition of two numbers does not depend on order).  With 3 ranks gloo's ring adds the three
contributions in an order that depends on where an element sits in the message, and our bucket
layout differs from native's (native rebuilds its buckets after the first step), so they agree
to float32 rounding only.
"""

from __future__ import annotations

import ddp_workers
import pytest
import torch
from test_naive_ddp import launch
from torch import nn

import ddplab
from ddplab.bucketed_ddp import MiB, assign_buckets


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch(ddp_workers.bucketed_checks, 2, tmp_path_factory.mktemp("bucketed"))


@pytest.mark.parametrize("case", [
    "vs_native", "vs_native_no_overlap", "vs_native_tiny_buckets", "vs_native_one_bucket",
    "vs_native_frozen", "vs_native_batchnorm", "vs_native_batchnorm_no_sync",
    "vs_native_no_sync", "vs_native_used_twice"])
def test_bit_for_bit_equal_to_native_ddp_on_two_ranks(two_ranks, case):
    assert two_ranks[case] == 0.0


def test_bucket_caps_and_frozen_parameters(two_ranks):
    buckets = two_ranks["buckets"]
    assert buckets["tiny"] == [["4.bias"], ["4.weight"], ["2.bias"], ["2.weight"],
                               ["0.bias"], ["0.weight"]]  # one per bucket, last layer first
    assert buckets["one"] == [["4.bias", "4.weight", "2.bias", "2.weight", "0.bias", "0.weight"]]
    assert buckets["frozen"] == [["4.bias", "4.weight", "2.bias", "2.weight"]]


def test_construction_copies_rank0s_parameters_and_buffers(two_ranks):
    assert two_ranks["replicas_equal_after_wrap"]


def test_timeline_records_one_comm_span_per_bucket(two_ranks):
    comm = [e for e in two_ranks["timeline"] if e[1] == "comm"]
    assert [name for name, *_ in comm] == [f"bucket {i}" for i in range(len(comm))]
    assert [args["bytes"] for *_, args in comm] == two_ranks["bucket_bytes"]
    assert all(0 <= start <= end for _, _, start, end, _ in comm)
    assert [e[0] for e in two_ranks["timeline"] if e[1] == "wait"] == ["wait for buckets"]


def test_an_unused_parameter_is_named_not_a_hang(two_ranks):
    failure = two_ranks["unused"]
    assert failure["type"] == "RuntimeError"
    assert "'unused.bias'" in failure["message"]
    assert "requires_grad_(False)" in failure["message"]
    assert two_ranks["unused_then_works"]["type"] is None  # the process group is still usable


def test_a_gradient_accumulated_twice_in_one_pass_is_an_error(two_ranks):
    failure = two_ranks["gradient_twice"]
    assert failure["type"] == "RuntimeError"
    assert "'shared.bias' got a gradient twice" in failure["message"]
    assert "use_reentrant=False" in failure["message"]


def test_one_forward_averages_one_backward(two_ranks):
    assert two_ranks["second_backward"]["after_first"] == 0.0   # averaged: equal everywhere
    assert two_ranks["second_backward"]["after_second"] > 0.0   # local only, as native DDP


def test_unused_on_one_rank_only_ends_the_run_quickly(tmp_path):
    with pytest.raises(ddplab.RankFailed) as failure:
        launch(ddp_workers.unused_on_rank0_only, 2, tmp_path, timeout=60)
    assert failure.value.rank == 0
    assert "got no gradient" in str(failure.value)


@pytest.mark.parametrize("world_size", [1, 3])
def test_other_world_sizes(world_size, tmp_path):
    result = launch(ddp_workers.equivalence_only, world_size, tmp_path)
    tolerance = 0.0 if world_size == 1 else 1e-6
    for case in ("bucketed", "bucketed_tiny_buckets", "bucketed_no_sync"):
        assert result[case] <= tolerance, case


def test_assign_buckets_reverse_order_cap_and_dtypes():
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 2))
    model[0].to(torch.float64)
    named = list(model.named_parameters())
    groups = [[name for name, _ in g] for g in assign_buckets(named, cap_bytes=MiB)]
    # 1.weight is exactly 1 MiB: it closes its bucket.  Layer 0 is float64: a bucket of its own.
    assert groups == [["2.bias", "2.weight", "1.bias", "1.weight"], ["0.bias", "0.weight"]]
    assert assign_buckets(named, cap_bytes=2**40) == [list(reversed(named[2:])),
                                                      list(reversed(named[:2]))]

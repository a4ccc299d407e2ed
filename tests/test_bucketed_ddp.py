"""BucketedDDP against native DistributedDataParallel, on gloo CPU ranks: bit for bit.

Native DDP (at its defaults: gradient_as_bucket_view=False, no comm hook,
find_unused_parameters=False) and BucketedDDP both multiply each gradient by 1/N while copying
it into its bucket (reducer.cpp, ``mark_variable_ready_dense``), then sum the buckets with one
all-reduce each.  With 2 ranks any bucket layout gives the same bits: a/2 + b/2 does not depend
on the order of the two terms.  From 3 ranks on, gloo's ring adds an element's N contributions
in an order that depends on the element's *offset in the message*: equal results need every
gradient at the same offset as in native's buckets — its first-iteration layout (definition
order, one bucket per dtype) and its rebuilt layout (gradient-ready order, capped).  BucketedDDP
copies both, so the tests ask for 0 at 2, 3 and 4 ranks; the control case (reverse order, never
rebuilt) shows that the layout is what matters.
"""

from __future__ import annotations

import ddp_workers
import pytest
import torch
from test_naive_ddp import launch
from torch import nn

import ddplab
from ddplab.bucketed_ddp import MiB, assign_buckets, bucket_caps, first_iteration_layout, pack

BITWISE = sorted(ddp_workers.BITWISE_CASES)


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n}_ranks")
def bitwise(request, tmp_path_factory):
    """One launch per world size runs every case (process start-up dominates the time)."""
    world_size = request.param
    results = launch(ddp_workers.bitwise_cases, world_size,
                     tmp_path_factory.mktemp(f"bitwise{world_size}"), timeout=300)
    return world_size, results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch(ddp_workers.bucketed_checks, 2, tmp_path_factory.mktemp("bucketed"))


@pytest.mark.parametrize("case", BITWISE)
def test_bit_for_bit_equal_to_native_ddp(bitwise, case):
    # Native DDP with its defaults and the same bucket_cap_mb (see ddp_workers.BITWISE_CASES):
    # parameters and buffers (and an eval output, for BatchNorm) after 4 steps, on every rank.
    world_size, results = bitwise
    assert results[case]["max_diff"] == 0.0, f"{case} at {world_size} ranks"


@pytest.mark.parametrize("case", BITWISE)
def test_bucket_layout_is_natives(bitwise, case):
    world_size, results = bitwise
    layouts = results[case]["layouts"]
    for when in ("first", "rebuilt"):
        ours, native = layouts[when]["ours"], layouts[when]["native"]
        if case.startswith("mixed_dtypes"):
            # Native appends the buckets still open at the end in the iteration order of a C++
            # unordered_map keyed by dtype: unspecified.  The order buckets are *launched* in
            # changes no sum (each bucket is its own all-reduce), so compare them as a set.
            ours, native = sorted(ours), sorted(native)
        assert ours == native, f"{case}, {when} layout at {world_size} ranks"


def test_the_layout_is_what_makes_it_bitwise(bitwise):
    world_size, results = bitwise
    control = results["control_reverse_order_layout"]["max_diff"]
    if world_size == 2:
        assert control == 0.0  # two terms: any order gives the same sum
    else:
        assert 0.0 < control < 1e-6  # same sums, other offsets: the last bits differ


def test_naive_ddp_is_bitwise_at_two_ranks_only(bitwise):
    # NaiveDDP sends one message per parameter and divides after the sum, (a + b + c) / 3: with
    # 3 or more ranks, other offsets (so another order of the N terms) and another rounding of
    # the 1/N, so only float32 rounding agrees.  The bound: a few float32 steps (2^-24 relative)
    # per SGD step on parameters of size ~1, far below 1e-6.
    world_size, results = bitwise
    for case in ("naive", "naive_no_sync"):
        if world_size == 2:
            assert results[case]["max_diff"] == 0.0, case
        else:
            assert results[case]["max_diff"] < 1e-6, case


def test_default_cap_is_natives_one_mib_first_bucket(bitwise):
    _, results = bitwise
    first, rebuilt = (results["wide_default_cap"]["layouts"][w]["ours"]
                      for w in ("first", "rebuilt"))
    assert len(first) == 1  # the first iteration: one bucket, definition order
    assert first[0][:2] == ["0.weight", "0.bias"]
    # Rebuilt in ready order: the last layer's 1 MiB weight closes the 1 MiB first bucket.
    assert rebuilt == [["6.bias", "6.weight", "4.bias", "4.weight"],
                       ["2.bias", "2.weight", "0.bias", "0.weight"]]


def test_construction_copies_rank0s_parameters_and_buffers(two_ranks):
    assert two_ranks["replicas_equal_after_wrap"]
    # forward_sync_buffers=False turns off the broadcast before forward, not the one at start.
    assert two_ranks["buffers_synced_at_construction_without_forward_sync"]


def test_native_buffer_sync_uses_a_keyword_that_does_not_warn(two_ranks):
    # torch 2.13 deprecated broadcast_buffers (FutureWarning); native_buffer_sync picks the
    # keyword the installed DDP has, so the book's runs print no deprecation warning.
    assert two_ranks["native_buffer_sync_warnings"] == []


def test_timeline_records_one_comm_span_per_bucket(two_ranks):
    comm = [e for e in two_ranks["timeline"] if e[1] == "comm"]
    assert [name for name, *_ in comm] == [f"bucket {i}" for i in range(len(comm))]
    assert [args["bytes"] for *_, args in comm] == two_ranks["bucket_bytes"]
    assert all(0 <= start <= end for _, _, start, end, _ in comm)
    assert [e[0] for e in two_ranks["timeline"] if e[1] == "wait"] == ["wait for buckets"]


def test_an_unused_parameter_is_named_not_a_hang(two_ranks):
    failure = two_ranks["unused"]
    assert failure["type"] == "RuntimeError"
    assert "'unused.weight'" in failure["message"]  # first in the first-iteration bucket
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


def test_pack_is_natives_rule_one_open_bucket_per_dtype():
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 2), nn.Linear(512, 512))
    model[1].to(torch.float64)
    named = list(model.named_parameters())
    groups = [[name for name, _ in g] for g in pack(named, [MiB, 2 * MiB])]
    # 0.weight is exactly 1 MiB: it closes the first float32 bucket at the first cap.  The
    # float64 layer in between does not close the float32 bucket: each dtype has its own.
    assert groups == [["0.weight"], ["0.bias", "2.weight", "2.bias"], ["1.weight", "1.bias"]]
    assert [[n for n, _ in g] for g in first_iteration_layout(named)] == [
        ["1.weight", "1.bias"], ["0.weight", "0.bias", "2.weight", "2.bias"]]
    assert [[n for n, _ in g] for g in assign_buckets(named, 2**40)] == [
        ["2.bias", "2.weight", "0.bias", "0.weight"], ["1.bias", "1.weight"]]


def test_bucket_caps_follow_native():
    assert bucket_caps(None) == (MiB, 25 * MiB)   # native's default: a 1 MiB first bucket
    assert bucket_caps(4) == (4 * MiB, 4 * MiB)   # an explicit cap: every bucket
    assert bucket_caps(1e-9) == (0, 0)            # int(), as native: one parameter per bucket

"""ShardedGradients (ZeRO-2 by hand) against native DDP with the same optimizer, on gloo CPU ranks.

The update is element-wise, so only the averaged gradient can differ, and on gloo a
reduce-scatter is an all-reduce of a clone (ProcessGroupGloo.cpp): a bucket laid out as native
DDP's gets native's bits if gloo's ring cuts it into the same segments.  Padding to the next
multiple of N keeps every segment boundary (⌈⌈n/N⌉/k⌉ = ⌈n/(kN)⌉), so the tests ask for 0 at 2, 3
and 4 ranks, padded or not, once native DDP has rebuilt its buckets (one backward without a
step: from then on its layout is ours).  Two controls: padding by one shard more, and native's
first-iteration layout; from 3 ranks on, some elements then sit in another segment and differ.
"""

from __future__ import annotations

import pytest
import zero_workers
from test_naive_ddp import launch

CASES = [f"{case}/{opt}" for case in zero_workers.ZERO2_CASES for opt in zero_workers.OPTIMIZERS]


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"{n}_ranks")
def zero2(request, tmp_path_factory):
    world_size = request.param
    results = launch(zero_workers.zero2_checks, world_size,
                     tmp_path_factory.mktemp(f"zero2_{world_size}"), timeout=300)
    return world_size, results


@pytest.mark.parametrize("case", CASES)
def test_bitwise_equal_to_native_ddp(zero2, case):
    # Parameters and optimizer state (all-gathered shards against the unsharded optimizer's)
    # after 4 steps, the largest difference over all ranks.
    world_size, results = zero2
    assert results[case]["params"] == 0.0, f"{case} at {world_size} ranks"
    assert results[case]["state"] == 0.0, f"{case} at {world_size} ranks"


def test_padding_to_the_next_multiple_keeps_the_bits_and_more_padding_does_not(zero2):
    # Reduce-scatter + all-gather against a plain all-reduce, n = 990 ... 1009.
    world_size, results = zero2
    differ = results["padding_control"]
    assert differ["minimal"] == []
    if world_size == 2:
        assert differ["one_more_shard"] == []  # two terms: a + b == b + a
    else:
        assert differ["one_more_shard"] != [], "one more shard of padding moved no element"


def test_layout_is_chapter_05s(zero2):
    _, results = zero2
    per_param = results["padded_one_bucket_per_param/adamw"]["layout"]
    assert per_param == [["4.bias"], ["4.weight"], ["2.bias"], ["2.weight"], ["0.bias"],
                         ["0.weight"]]
    one = results["padded_one_bucket/adamw"]["layout"]
    assert one == [["4.bias", "4.weight", "2.bias", "2.weight", "0.bias", "0.weight"]]


def test_bytes_per_step_counted_equal_measured(zero2):
    world_size, results = zero2
    found = results["bytes"]
    assert found["recorded"] == found["predicted"]
    assert found["measured_sent"] == found["predicted_sent"]
    assert found["measured_sent_gloo"] == found["predicted_sent_gloo"]
    # A ring reduce-scatter and all-gather send what DDP's all-reduce sends, padding included.
    padded_bytes = 4 * found["padded_numel"]
    assert found["predicted_sent"] == 2 * (world_size - 1) / world_size * padded_bytes
    assert found["predicted_sent_gloo"] == 3 * (world_size - 1) / world_size * padded_bytes


def test_only_the_shard_of_the_gradient_is_kept(zero2):
    world_size, results = zero2
    found = results["bytes"]
    assert found["full_grads_kept"] == 0
    assert sum(found["shard_grad_numels"]) * world_size == found["padded_numel"]


def test_a_second_backward_adds_to_the_shards_gradient(zero2):
    # The same batch twice: x + x == 2x exactly in floating point.
    _, results = zero2
    assert results["bytes"]["second_backward_vs_twice_the_first"] == 0.0


def test_native_first_iteration_layout_is_why_the_comparison_waits_for_the_rebuild(zero2):
    # Without the warm-up, native's first step reduces one bucket in definition order: other
    # offsets, other segments, so from 3 ranks on some sums are added in another order.
    world_size, results = zero2
    control = results["control_native_first_layout"]
    if world_size == 2:
        assert control["params"] == 0.0
    else:
        assert 0.0 < max(control["params"], control["state"]) < 1e-6

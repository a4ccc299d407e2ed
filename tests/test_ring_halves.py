"""Chapter 03's ring in two halves (ddplab.ring_halves) against gloo's reduce-scatter and
all-gather, on real ranks; ZeRO-3's traffic and the hiding threshold in the cost model."""

from __future__ import annotations

import warnings

import pytest
import ring_halves_workers
from conftest import launch_forked

import ddplab
from ddplab import costmodel


def parse(world_size: int, out):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 3 or 4 ranks on a 2-core machine warns, on purpose
        return ddplab.parse_chapter_args(ddplab.chapter_parser("test"),
                                         ["--world-size", str(world_size), "--out", str(out),
                                          "--timeout", "120"])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_halves_equal_gloos_collectives(world_size, tmp_path):
    run = launch_forked(ring_halves_workers.halves_against_gloo, parse(world_size, tmp_path))
    every = run.result
    for rank, found in enumerate(every):
        for case, checks in found.items():
            assert checks["input_unchanged"], (rank, case)
            assert checks["all_gather_equal"], (rank, case)
            if case.startswith("integers"):  # sums of small integers are exact in any order
                assert checks["reduce_scatter"] == 0.0, (rank, case)
            else:  # random floats: the same sum, perhaps in another order
                assert checks["reduce_scatter"] < 1e-5, (rank, case)


def test_zero3_sends_one_and_a_half_times_ddp_and_keeping_gathers_sends_as_much():
    full = costmodel.zero3_bytes_per_step(1000.0, 4)
    assert full == {"ddp": 1500.0, "fsdp": 2250.0, "ratio": 1.5}
    kept = costmodel.zero3_bytes_per_step(1000.0, 4, reshard_after_forward=False)
    assert kept["fsdp"] == kept["ddp"] == 1500.0


def test_the_hiding_threshold_grows_with_a_slower_link_and_is_one_gathers_compute():
    layer = 12 * 4096**2
    fast = costmodel.fsdp_hiding_threshold(layer, 64, link="nvlink4")
    slow = costmodel.fsdp_hiding_threshold(layer, 64, link="eth-100g")
    assert slow["tokens_per_rank"] > fast["tokens_per_rank"]
    # At the threshold a layer's forward (2 FLOPs per parameter per token) takes one gather.
    flops_per_s = 989.0e12 * 0.4
    assert 2 * layer * fast["tokens_per_rank"] / flops_per_s == pytest.approx(fast["gather_s"])
    assert fast["tokens_per_rank"] >= fast["bandwidth_only_tokens"]  # α only adds

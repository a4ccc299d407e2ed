"""NaiveDDP against native DistributedDataParallel, on gloo CPU ranks.

With 2 ranks every gradient element is a + b, and IEEE addition is commutative, so NaiveDDP's
(a + b) / 2 and native's a/2 + b/2 are bit-for-bit equal (halving is exact).  With 3 ranks or
more NaiveDDP cannot be bitwise equal to native DDP: each parameter is its own message, so an
element's N terms are added in an order set by its offset in *that* message, not in native's
bucket; and (a + b + c) / 3 rounds differently from a·fl(1/3) + b·fl(1/3) + c·fl(1/3).  They
agree to float32 rounding: tests/test_bucketed_ddp.py checks that bound at 3 and 4 ranks, in the
same launch as the bitwise cases.
"""

from __future__ import annotations

import warnings

import ddp_workers
import pytest
from conftest import launch_forked

import ddplab


def launch(worker, world_size: int, tmp_path, timeout: float = 60):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 3 ranks on a 2-core machine warns, on purpose
        args = ddplab.parse_chapter_args(ddplab.chapter_parser("test"), [
            "--world-size", str(world_size), "--timeout", str(timeout), "--out", str(tmp_path)])
    return launch_forked(worker, args).result


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch(ddp_workers.naive_checks, 2, tmp_path_factory.mktemp("naive"))


@pytest.mark.parametrize("case", ["vs_native", "vs_native_no_sync", "vs_native_frozen"])
def test_bit_for_bit_equal_to_native_ddp_on_two_ranks(two_ranks, case):
    assert two_ranks[case] == 0.0


def test_sync_gradients_averages(two_ranks):
    assert two_ranks["sync_averages"] == 0.0


def test_different_seeds_raise_a_value_error_that_says_what_to_do(two_ranks):
    failure = two_ranks["seed_mismatch"]
    assert failure["type"] == "ValueError"
    assert "0.weight" in failure["message"]       # the first parameter that differs
    assert "rank(s) [1]" in failure["message"]    # rank 0 raises too, and says who differs
    assert "manual_seed" in failure["message"]


def test_no_sync_skips_communication_and_restores_the_switch(two_ranks):
    assert two_ranks["no_sync_keeps_local_grads"]
    assert two_ranks["sync_after_no_sync"]


def test_it_behaves_like_the_wrapped_module(two_ranks):
    assert two_ranks["eval_reaches_module"]
    assert two_ranks["forward_delegates"]

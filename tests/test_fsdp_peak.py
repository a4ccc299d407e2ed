"""FullyShardedDP's peak memory within a step, against ``fully_shard``'s: never above it.

Measured without timing and without threads: one process plays rank 0 of 2 on a fake process
group (``torch.testing._internal.distributed.fake_pg``: collectives return at once, on the
calling thread, and move no data), so the profiler sees every allocation and every free, and
the peak of a step is the same bytes on every run.  gloo would add its own buffers (a
reduce-scatter clones its input) and may free them on its worker thread, out of the profiler's
sight; those buffers are the same size for both, since both send the same messages.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from backstage.chapter11_bench import fake_group_peaks

WORLD = 2
KINDS = ("fsdp_ours", "fully_shard")


@pytest.fixture(scope="module")
def peaks():
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fake_group_peaks, WORLD, 0).result(timeout=600)


def test_the_measure_is_exact(peaks):
    for kind in KINDS:
        first, second = peaks[kind]
        assert first == second, f"{kind}: two equal steps peaked at {first} and {second} B"


def test_our_peak_is_at_most_fully_shards(peaks):
    ours, theirs = peaks["fsdp_ours"][0], peaks["fully_shard"][0]
    assert ours <= theirs, f"FullyShardedDP peaked at {ours:,} B, fully_shard at {theirs:,} B"

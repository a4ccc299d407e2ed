"""FullyShardedDP's peak memory within a step, against ``fully_shard``'s: never above it.

Measured without timing and without threads: one process plays rank 0 of 2 on a fake process
group (``torch.testing._internal.distributed.fake_pg``: collectives return at once, on the
calling thread, and move no data), so the profiler sees every allocation and every free, and
the peak of a step is the same bytes on every run.  gloo would add its own buffers (a
reduce-scatter clones its input) and may free them on its worker thread, out of the profiler's
sight; those buffers are the same size for both, since both send the same messages.
"""

from __future__ import annotations

import gc
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

WORLD = 2
KINDS = ("fsdp_ours", "fully_shard")


def step_peaks(world: int, rank: int) -> dict:
    """The profiler's peak while each is built and takes three steps, on the benchmark's
    model, twice: everything it frees was allocated in sight of the profiler."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from backstage.chapter11_bench import build, stepper
    from backstage.chapter11_probe import profiler_peak_bytes

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
        def train(kind):
            step = stepper(*build(kind, torch.device("cpu")), x, y)
            for _ in range(3):  # from the second on, the optimizer's state is there too
                step()

        def measured(kind):
            gc.collect()  # a wrapped model is a reference cycle: freed now, not in sight
            return profiler_peak_bytes(lambda: train(kind))

        return {kind: [measured(kind) for _ in range(2)] for kind in KINDS}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def peaks():
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(step_peaks, WORLD, 0).result(timeout=600)


def test_the_measure_is_exact(peaks):
    for kind in KINDS:
        first, second = peaks[kind]
        assert first == second, f"{kind}: two equal steps peaked at {first} and {second} B"


def test_our_peak_is_at_most_fully_shards(peaks):
    ours, theirs = peaks["fsdp_ours"][0], peaks["fully_shard"][0]
    assert ours <= theirs, f"FullyShardedDP peaked at {ours:,} B, fully_shard at {theirs:,} B"

"""ddplab.ring_all_reduce (and the naive all-reduce) against dist.all_reduce, on real ranks."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import ring_workers
from conftest import launch_forked

import ddplab
from ddplab import ring


def parse(*argv: str, out: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 3 or 4 ranks on a 2-core machine warns, on purpose
        return ddplab.parse_chapter_args(ddplab.chapter_parser("test"),
                                         [*argv, "--out", str(out), "--timeout", "60"])


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_matches_dist_all_reduce_for_every_size_and_dtype(world_size, tmp_path):
    # One launch per world size runs the whole matrix: sizes 0, 1, N-1, N+1, odd primes and
    # 1M+3; float32, float64 and int64; plus a transposed tensor, tiny segments, a sub-group.
    run = launch_forked(ring_workers.correctness_matrix,
                        parse("--world-size", str(world_size), out=tmp_path))
    assert run.result == []


@pytest.mark.parametrize("world_size", [2, 3])
def test_receive_buffers_are_reused_from_call_to_call(world_size, tmp_path):
    run = launch_forked(ring_workers.kept_receive_buffers,
                        parse("--world-size", str(world_size), out=tmp_path))
    report, problems = run.result
    assert problems == []
    first, same_size, smaller, float64, back = report
    # One buffer per receive posted ahead; N=2 adds only one piece, so it needs only one.
    slots = range(min(ring.IN_FLIGHT, world_size - 1))
    assert set(first) == {f"{slot} torch.float32" for slot in slots}
    assert same_size == first  # the same memory, not a new allocation
    assert smaller == first  # a smaller piece lands in the front of the same buffer
    assert float64 == first | {f"{slot} torch.float64": float64[f"{slot} torch.float64"]
                               for slot in slots}  # float64 did not evict float32's
    assert back == float64


def test_a_call_that_did_not_finish_never_hands_its_buffers_on():
    from ddplab.ring import _KeptBuffers

    kept = _KeptBuffers()
    held = kept.take()
    held["slot"] = "a buffer a receive may still be writing"
    assert kept.take() == {}  # a call made meanwhile (or after a failure) starts afresh
    kept.put_back(held)  # only a finished call gives its buffers back
    assert kept.take() == {"slot": "a buffer a receive may still be writing"}
    seen = []
    thread = threading.Thread(target=lambda: seen.append(kept.take()))
    kept.put_back(held)
    thread.start()
    thread.join()
    assert seen == [{}]  # another thread has its own set


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_nccl_exchange_gives_the_same_sums(world_size, tmp_path):
    # No GPUs here: run the grouped exchange (the nccl path) on gloo, which accepts it too.
    run = launch_forked(ring_workers.grouped_exchange_matrix,
                        parse("--world-size", str(world_size), out=tmp_path))
    assert run.result == []


def test_ranks_with_different_sizes_or_dtypes_get_an_error_not_a_hang(tmp_path):
    # A hang would end in a RankFailed after --timeout, not in these messages on every rank.
    run = launch_forked(ring_workers.mismatched_tensors, parse("--world-size", "3", out=tmp_path))
    for size_message, dtype_message in run.result:  # every rank raised, the same error
        assert "different sizes" in size_message
        assert "numel from 10 to 11" in size_message
        assert "different dtypes" in dtype_message


def test_trace_records_the_two_phases_in_ring_order(tmp_path):
    run = launch_forked(ring_workers.traced_ring, parse("--world-size", "3", out=tmp_path))
    n = 3
    for rank, records in enumerate(run.result):
        phases = [r[0] for r in records]
        assert phases == ["reduce-scatter"] * (n - 1) + ["all-gather"] * (n - 1)
        for phase, step, sent, received, _ in records:
            if phase == "reduce-scatter":
                assert (sent, received) == ((rank - step) % n, (rank - step - 1) % n)
            else:
                assert (sent, received) == ((rank + 1 - step) % n, (rank - step) % n)
        # After the reduce-scatter, rank r owns the finished sum of chunk r+1 (3 ones × 3 ranks).
        assert records[n - 2][4][(rank + 1) % n] == 3 * n
        assert records[-1][4] == [3 * n] * n  # and at the end everyone has every sum

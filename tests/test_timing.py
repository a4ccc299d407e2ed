"""ddplab.timing.compare's rotation and progress hooks (single process: no collectives)."""

from __future__ import annotations

from ddplab import timing


def test_rotate_starts_each_round_with_the_next_variant():
    order = []
    samples = timing.compare({n: (lambda n=n: order.append(n)) for n in "abc"}, rounds=4,
                             warmup=0, rotate=True)
    assert "".join(order) == "abc" "bca" "cab" "abc"
    assert {n: len(s) for n, s in samples.items()} == {"a": 4, "b": 4, "c": 4}


def test_progress_wraps_the_rounds():
    seen = []

    def progress(rounds):
        for r in rounds:
            seen.append(r)
            yield r
    timing.compare({"a": lambda: None}, rounds=3, warmup=1, progress=progress)
    assert seen == [0, 1, 2]


def test_slowest_rank_per_step_is_the_identity_without_a_process_group():
    samples = {"a": [1.0, 2.0]}
    assert timing.slowest_rank_per_step(samples) == samples

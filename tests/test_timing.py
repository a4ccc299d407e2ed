"""ddplab.run.timing.compare's shuffled order and progress hook (single process: no collectives)."""

from __future__ import annotations

from ddplab.run import timing


def test_shuffle_varies_the_order_the_same_way_on_every_rank():
    def run() -> list[str]:
        order = []
        timing.compare({n: (lambda n=n: order.append(n)) for n in "abcd"}, rounds=12,
                       warmup=0, shuffle=True)
        return ["".join(order[i:i + 4]) for i in range(0, len(order), 4)]
    rounds = run()
    assert rounds == run()  # drawn from the round number: identical on every rank
    assert all(sorted(r) == list("abcd") for r in rounds)
    predecessors_of_b = {r[r.index("b") - 1] for r in rounds if r.index("b") > 0}
    assert len(predecessors_of_b) > 1  # not always the same neighbour


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

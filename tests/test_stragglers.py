"""ddplab.stragglers: idle time from a step's events, the fitted slope, the bubble spans."""

from __future__ import annotations

import pytest

from ddplab import stragglers
from ddplab.timeline import Event


def step(rank: int, launches: list[float], backward=(10.0, 40.0), offset: float = 0.0):
    """A backward pass from 10 to 40 ms with bucket all-reduces launched at ``launches``."""
    b0, b1 = backward
    events = [Event("forward", "forward", offset, offset + b0, rank),
              Event("backward", "backward", offset + b0, offset + b1, rank)]
    events += [Event(f"bucket {i}", "comm", offset + t, offset + b1 - 0.5, rank)
               for i, t in enumerate(launches)]
    return events


def test_idle_is_from_the_last_bucket_launch_to_the_end_of_backward():
    events = step(0, [12.0, 15.0, 18.0]) + step(1, [30.0, 35.0])
    assert stragglers.comm_idle_ms(events, 0) == pytest.approx(22.0)
    assert stragglers.comm_idle_ms(events, 1) == pytest.approx(5.0)


def test_comm_outside_backward_is_not_a_gradient_bucket():
    events = [*step(0, [12.0]), Event("loss all-reduce", "comm", 41.0, 42.0, 0)]
    assert stragglers.comm_idle_ms(events, 0) == pytest.approx(28.0)


def test_a_step_without_buckets_is_an_error():
    with pytest.raises(ValueError, match="no bucket all-reduce"):
        stragglers.comm_idle_ms(step(0, []), 0)


def test_idle_events_one_per_backward_and_rank():
    events = step(0, [12.0]) + step(0, [62.0], backward=(60.0, 90.0)) + step(1, [38.0])
    spans = stragglers.idle_events(events)
    assert [(e.rank, e.start_ms, e.end_ms, e.cat) for e in spans] == [
        (0, 12.0, 40.0, "idle"), (0, 62.0, 90.0, "idle"), (1, 38.0, 40.0, "idle")]


def test_fit_line_recovers_slope_and_intercept():
    slope, intercept = stragglers.fit_line([0, 10, 20, 40], [3.0, 13.0, 23.0, 43.0])
    assert slope == pytest.approx(1.0)
    assert intercept == pytest.approx(3.0)


def test_inject_delay_sleeps_at_least_that_long():
    import time

    start = time.perf_counter()
    stragglers.inject_delay(20)
    assert time.perf_counter() - start >= 0.019
    stragglers.inject_delay(0)  # no-op

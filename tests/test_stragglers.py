"""ddplab.stragglers: idle time from a step's events, the fitted slope, the bubble spans."""

from __future__ import annotations

import pytest
import torch
from conftest import launch_forked

from ddplab import stragglers
from ddplab.run.timeline import Event


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


def test_buckets_in_flight_at_the_last_launch():
    events = step(0, [12.0, 15.0, 18.0])                    # all end at 39.5: three in flight
    events.append(Event("bucket 3", "comm", 13.0, 14.0, 0))  # done before the last launch
    assert stragglers.in_flight_at_last_launch(events, 0) == 3


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


def test_fit_line_is_not_pulled_off_by_one_stalled_step():
    ys = [3.0, 13.0, 63.0, 33.0, 43.0]        # the step at d = 20 was stalled by 40 ms
    slope, intercept = stragglers.fit_line([0, 10, 20, 30, 40], ys)
    assert slope == pytest.approx(1.0) and intercept == pytest.approx(3.0)


def test_inject_delay_sleeps_at_least_that_long():
    import time

    start = time.perf_counter()
    stragglers.inject_delay(20)
    assert time.perf_counter() - start >= 0.019
    stragglers.inject_delay(0)  # no-op


def _launch(worker, world_size: int, tmp_path):
    import bubble_workers

    import ddplab

    args = ddplab.parse_chapter_args(ddplab.chapter_parser("test"),
                                     ["--world-size", str(world_size), "--out", str(tmp_path)])
    return launch_forked(getattr(bubble_workers, worker), args).result


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_timing_hook_averages_like_ddp_bitwise_only_at_powers_of_two(world_size, tmp_path):
    """Built-in DDP multiplies by fl(1/N) while copying into the bucket (reducer.cpp,
    mark_variable_ready_dense); with a hook DDP copies unscaled and the hook divides by N.
    At N = 2 and 4, 1/N is exact: the same bits.  At N = 3 each term is rounded differently:
    the averaged gradient may differ by a few units in the last place of the terms' size —
    bounded by 2 eps * sum over ranks of |g_r| (one rounding of each term, two in the sum)."""
    result = _launch("hook_against_built_in", world_size, tmp_path)
    if world_size in (2, 4):
        assert result["max_abs_diff"] == 0.0
    else:
        assert result["max_abs_diff"] > 0.0           # the difference is real at N = 3...
        eps = torch.finfo(torch.float32).eps
        assert result["max_ratio_to_bound"] <= 2 * eps  # ...and only rounding


def test_no_forward_buffer_sync_warns_nothing_and_keeps_the_sync_at_construction(tmp_path):
    result = _launch("buffers_with_forward_sync_off", 2, tmp_path)
    assert result["warnings"] == []
    assert result["buffers_equal_after_init"] and result["mean_after_init"] == [1.0] * 4
    assert "broadcast" not in result["collectives"]   # no per-forward broadcast...
    assert result["collectives"]["all_reduce"] >= 1   # ...but the gradients still are averaged


def test_no_forward_buffer_sync_falls_back_on_torch_without_forward_sync_buffers():
    class OldDDP:
        def __init__(self, module, broadcast_buffers=True):
            pass

    class NewDDP:
        def __init__(self, module, broadcast_buffers=None, forward_sync_buffers=None):
            pass

    assert stragglers.no_forward_buffer_sync(OldDDP) == {"broadcast_buffers": False}
    assert stragglers.no_forward_buffer_sync(NewDDP) == {"forward_sync_buffers": False}


def test_a_gpu_timeline_stamps_with_cuda_events_and_reads_them_late(monkeypatch):
    """On a GPU every stamp is a CUDA event (the GPU's clock, not the host's launch time); the
    events are read, waiting for them, only when ``events`` is looked at.  Faked here: the
    test machine has no GPU, the logic is the same."""
    from ddplab.run import timeline

    gpu_clock = [0.0]
    recorded = []

    class FakeEvent:
        def __init__(self):
            self.at, self.waited = gpu_clock[0], False
            recorded.append(self)

        def synchronize(self):
            self.waited = True

        def elapsed_time(self, later):
            assert later.waited, "read before the GPU got there"
            return later.at - self.at

    monkeypatch.setattr(timeline, "_cuda_event", FakeEvent)
    tl = timeline.Timeline(0, device="cuda")
    gpu_clock[0] = 5.0
    tl.start_clock()
    gpu_clock[0] = 7.0
    with tl.span("forward", "forward"):
        gpu_clock[0] = 10.0
    launched = tl.now()            # a bucket handed to the network...
    gpu_clock[0] = 12.5
    tl.add("bucket 0", "comm", launched, tl.now())   # ...and done, stamped in its callback
    assert not any(e.waited for e in recorded)      # nothing waited for while recording
    assert [(e.name, e.start_ms, e.end_ms) for e in tl.events] == [
        ("forward", 2.0, 5.0), ("bucket 0", 5.0, 7.5)]
    assert tl.elapsed_ms() == 7.5
    tl.start_clock()
    assert tl.events == []


def _waits_here():  # a demo function of this file, for where_it_waited
    pass


def test_where_a_hung_rank_waited_is_its_demo_files_last_line():
    from ddplab.run import hangs

    details = ('Traceback (most recent call last):\n'
               '  File "/x/ddplab/hangs.py", line 80, in _with_flight_recorder\n'
               '    args.demo(ctx, args)\n'
               '  File "/x/tests/test_stragglers.py", line 12, in uneven\n'
               '    dist.barrier()  # everyone done\n'
               '  File "/x/torch/distributed/c10d_logger.py", line 81, in wrapper\n'
               '    return func(*args, **kwargs)\n')
    assert hangs.where_it_waited(details, _waits_here) == "uneven(): dist.barrier()"
    assert hangs.where_it_waited("no traceback", _waits_here) == "unknown"


def test_the_flight_recorder_switch_restores_the_environment(monkeypatch):
    import os

    from ddplab.run import hangs

    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    with hangs.flight_recorder_on(16):
        assert os.environ["TORCH_FR_BUFFER_SIZE"] == "16"
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ

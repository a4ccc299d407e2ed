"""Where ranks wait: a late rank, the time the others spend idle, and how to measure both.

A data-parallel step ends with a collective (the gradient all-reduce), so every rank finishes the
step when the *slowest* one does.  The others sit idle in the all-reduce: a *bubble*.  This
module makes that measurable:

* ``inject_delay``: make one rank late on purpose (a slow data loader, a busier GPU);
* ``timed_allreduce_hook``: a native-DDP communication hook that averages each bucket with one
  all-reduce, as DDP's built-in path does, and records it on a ``Timeline`` (it divides the
  bucket by N where the built-in path multiplies by fl(1/N) while copying: the same bits only
  when N is a power of two);
* ``comm_idle_ms``: from one step's events, the time a rank spent waiting for communication
  after its own gradients were ready;
* ``fit_line``: the slope of idle time (or step time) against the injected delay;
* ``count_collectives``: which collectives one step really issues (torch.profiler's view);
* ``no_forward_buffer_sync``: DDP's arguments that skip the per-step buffer broadcast;
* ``rank0_work_numbers``, ``buckets_in_flight``: two numbers read off a recorded timeline.
"""

# No ``from __future__ import annotations`` here: DDP checks a comm hook's annotations, and
# would reject them as strings.
import inspect
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .run.timeline import Event, Timeline


# --8<-- [start:inject_delay]
def inject_delay(delay_ms: float) -> None:
    """Be late by ``delay_ms``: what a slow data loader or a slower GPU does to one rank.

    ``sleep`` rather than busy work, so the late rank does not take CPU time from the others:
    on a small CPU machine, busy work would slow every rank and blur what we want to see.
    """
    if delay_ms > 0:
        time.sleep(delay_ms / 1e3)
# --8<-- [end:inject_delay]


# How it times, on either clock: the span starts when DDP hands the bucket over and ends in the
# ``then`` callback, which runs when the all-reduce has completed (gloo: on the backend's thread).
# On a GPU the timeline's stamps are CUDA events: the first on the stream that computed the
# gradients, the second in ``then``, whose stream is made to wait for the all-reduce
# (torch/futures/__init__.py, Future.then) — GPU times, not launch times.
#
# Not bit for bit DDP's built-in averaging: without a hook DDP multiplies each gradient by
# ``1/N`` (rounded) while copying it into the bucket (reducer.cpp, mark_variable_ready_dense);
# with a hook it copies the gradient unscaled and ``div_(N)`` below divides.  The same bits when
# N is a power of two (1/N is exact); otherwise they can differ in the last bit.  torch's own
# ``default_hooks.allreduce_hook`` divides the same way.  (tests/test_stragglers.py)

# --8<-- [start:hook]
def timed_allreduce_hook(timeline: Timeline) -> Callable:
    """A DDP communication hook: average a bucket with one all-reduce, and time it.

    ``ddp.register_comm_hook(None, timed_allreduce_hook(timeline))`` *replaces* DDP's built-in
    all-reduce (once, before the first backward).  DDP calls the hook when a bucket's gradients
    are all ready; the hook starts the communication and returns a Future of the averaged bucket.
    """
    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        start = timeline.now()
        group = state if state is not None else dist.group.WORLD
        grads = bucket.buffer().div_(dist.get_world_size(group))  # average = sum of grad / N
        future = dist.all_reduce(grads, group=group, async_op=True).get_future()
        name = f"bucket {bucket.index()}"  # now: native's bucket object is gone when record runs

        def record(done: torch.futures.Future) -> torch.Tensor:
            timeline.add(name, "comm", start, timeline.now(),
                         bytes=grads.numel() * grads.element_size())
            return done.value()[0]
        return future.then(record)
    return hook
# --8<-- [end:hook]


def time_ddp_pre_forward(ddp: torch.nn.Module, timeline: Timeline) -> None:
    """Record what native DDP does before it runs the module's forward, as a ``comm`` span.

    By default, for a model with buffers (BatchNorm's running statistics), that is a broadcast
    from rank 0 in every training forward: a sync point at the very start of the step.  Two
    hooks bracket it: one on the DDP wrapper, one on the inner module.
    """
    started: list[float] = []
    ddp.register_forward_pre_hook(lambda module, args: started.append(timeline.now()))
    ddp.module.register_forward_pre_hook(lambda module, args: timeline.add(
        "DDP pre-forward: broadcast buffers", "comm", started.pop(), timeline.now()))


# --8<-- [start:idle]
def comm_idle_ms(events: list[Event], rank: int) -> float:
    """How long ``rank`` waited for communication in the one step that ``events`` hold.

    The last bucket is handed to the network the moment this rank's last gradient is ready:
    from then on it has nothing left to compute.  Everything until ``backward()`` returns is
    waiting — for the network, and for any rank that is later than this one.
    """
    mine = [e for e in events if e.rank == rank]
    backward = next(e for e in mine if e.cat == "backward")
    launches = [e.start_ms for e in mine if e.cat == "comm"
                and backward.start_ms <= e.start_ms <= backward.end_ms]
    if not launches:
        raise ValueError(f"rank {rank}: no bucket all-reduce started during backward; "
                         "was the model wrapped with a timeline?")
    return backward.end_ms - max(launches)
# --8<-- [end:idle]


def in_flight_at_last_launch(events: list[Event], rank: int) -> int:
    """Buckets still in flight (the last one included) when ``rank`` launched its last bucket
    in the one backward pass that ``events`` hold: the queue the idle time waits for."""
    mine = [e for e in events if e.rank == rank and e.cat == "comm"]
    last = max(e.start_ms for e in mine)
    return sum(1 for e in mine if e.start_ms <= last < e.end_ms)


def idle_events(events: list[Event]) -> list[Event]:
    """One ``idle`` span per rank and backward pass (for drawing the bubble on a Gantt chart)."""
    spans = []
    for rank in sorted({e.rank for e in events}):
        for backward in (e for e in events if e.rank == rank and e.cat == "backward"):
            inside = [e for e in events if e.rank == rank and backward.start_ms <= e.start_ms
                      <= backward.end_ms]
            idle = comm_idle_ms(inside, rank)
            spans.append(Event("waiting for communication", "idle", backward.end_ms - idle,
                               backward.end_ms, rank))
    return spans


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """A robust ``(slope, intercept)`` of ys against xs (Theil-Sen: the median of the slopes
    between all pairs of points).  On a shared machine one stalled step can pull a
    least-squares line far off; a median of pairwise slopes barely moves."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i])
              for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    slope = statistics.median(slopes)
    return slope, statistics.median(y - slope * x for x, y in zip(xs, ys, strict=True))


# --8<-- [start:count]
def count_collectives(step: Callable[[], object]) -> Counter:
    """Run ``step`` once under torch.profiler; count the collectives the backend executed.

    Profiler events named ``gloo:all_reduce``, ``nccl:broadcast``, … are recorded by the
    process group itself, so this sees every collective — DDP's buckets, its buffer
    broadcasts, SyncBatchNorm's statistics — not only the ones our own code calls.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    with _quiet_native_stderr():
        prof.start()
    try:
        step()
    finally:
        with _quiet_native_stderr():
            prof.stop()
    backend = dist.get_backend()
    return Counter(e.name.split(":", 1)[1] for e in prof.events()
                   if e.name.startswith(f"{backend}:"))
# --8<-- [end:count]


# --8<-- [start:buffer_sync]
def no_forward_buffer_sync(ddp_class: type = torch.nn.parallel.DistributedDataParallel) -> dict:
    """DDP arguments that skip the buffer broadcast before every forward, and only it.

    torch >= 2.13: ``forward_sync_buffers=False``; buffers are still made equal once, at
    construction.  Older torch has only ``broadcast_buffers=False``, which skips that
    construction-time sync too (torch 2.13 deprecates it with a FutureWarning for that reason):
    call ``broadcast_buffers_once`` after wrapping to get the same start.
    """
    if "forward_sync_buffers" in inspect.signature(ddp_class.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def broadcast_buffers_once(module: torch.nn.Module) -> None:
    """Copy rank 0's buffers to every rank (what DDP's constructor does for them)."""
    for buffer in module.buffers():
        dist.broadcast(buffer, src=0)
# --8<-- [end:buffer_sync]




@contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Silence file descriptor 2 for a moment: torch 2.13's profiler prints a
    ``USDT: … profiler_start`` line from C++ on every start and stop, with no switch to turn
    it off; those lines would only puzzle a reader."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def rank0_work_numbers(events, after_step: int = 1) -> dict:
    """rank 0's evaluate+save time, and how long the others then waited in the next step."""
    work = next(e for e in events if e.cat == "eval")
    idle = idle_events(events)
    others = [e for e in idle if e.rank != 0]
    nxt = [sorted((e for e in others if e.rank == r), key=lambda e: e.start_ms)[after_step + 1]
           for r in sorted({e.rank for e in others})]
    return {"eval_ms": work.duration_ms,
            "idle_ms_other_ranks": statistics.fmean(e.duration_ms for e in nxt)}


def buckets_in_flight(events: list[Event]) -> int:
    """Median over ranks and backward passes: buckets in flight at the last bucket's launch."""
    counts = []
    for rank in sorted({e.rank for e in events}):
        for backward in (e for e in events if e.rank == rank and e.cat == "backward"):
            inside = [e for e in events if e.rank == rank
                      and backward.start_ms <= e.start_ms <= backward.end_ms]
            counts.append(in_flight_at_last_launch(inside, rank))
    return statistics.median_low(counts)   # a count that happened, not a half

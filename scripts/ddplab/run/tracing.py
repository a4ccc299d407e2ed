"""BucketTrace: BucketedDDP's buckets on a timeline, layered on without touching its logic.

``BucketedDDP(..., timeline=tl)`` attaches one: it wraps the wrapper's two methods that launch
and finish the buckets, so the teaching code in bucketed_ddp.py stays free of bookkeeping.  Each
bucket becomes a ``comm`` span ``bucket {i}`` (with its size in bytes), and the wait at the end
of backward a ``wait`` span ``wait for buckets``.

Which clock: the host's.  A bucket's span ends when its Work's future completes.  On gloo that
is when the all-reduce has finished; on nccl the future completes when the collective is
*enqueued* on the GPU stream, so the span measures the launch, not the transfer: time GPU work
with CUDA events or the profiler instead.
"""

from __future__ import annotations

import weakref

from .timeline import Timeline


class BucketTrace:
    def __init__(self, timeline: Timeline):
        self.timeline = timeline
        self._launched: list[tuple[object, float]] = []  # (bucket, launch time), this pass
        self._done_ms: dict[int, float] = {}

    def attach(self, ddp) -> None:
        """Record ``ddp``'s bucket launches and its end-of-backward wait.  The wrappers hold
        ``ddp`` weakly, like its gradient hooks: no reference cycle keeps a dropped one alive."""
        launch, finish = type(ddp)._launch_full_buckets, type(ddp)._finish_backward
        ddp_ref = weakref.ref(ddp)

        def launch_and_record() -> None:
            ddp = ddp_ref()
            first, started = ddp._next_bucket, self.timeline.now()
            launch(ddp)
            for bucket in ddp.buckets[first:ddp._next_bucket]:
                self._record_launch(bucket, started)

        def finish_and_record() -> None:
            waiting = self.timeline.now()
            try:
                finish(ddp_ref())
            finally:
                self._record_pass(waiting)

        ddp._launch_full_buckets, ddp._finish_backward = launch_and_record, finish_and_record

    def _record_launch(self, bucket, started: float) -> None:
        self._launched.append((bucket, started))
        self._done_ms.pop(bucket.index, None)
        done, now, index = self._done_ms, self.timeline.now, bucket.index

        def record(_future) -> None:  # on the communication thread, when the bucket is done
            done[index] = now()
        work = bucket.work  # a dist.Work, or the Future a comm hook returned
        (work.get_future() if hasattr(work, "get_future") else work).add_done_callback(record)

    def _record_pass(self, waiting: float) -> None:
        now = self.timeline.now()
        self.timeline.add("wait for buckets", "wait", waiting, now)
        for bucket, started in self._launched:
            self.timeline.add(f"bucket {bucket.index}", "comm", started,
                              self._done_ms.get(bucket.index, now), bytes=bucket.nbytes)
        self._launched.clear()

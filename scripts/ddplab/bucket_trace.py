"""BucketTrace: BucketedDDP's buckets on a timeline, layered on without touching its logic.

``BucketedDDP(..., timeline=tl)`` calls three methods: ``launched`` when a bucket's all-reduce
starts, ``waiting`` when backward has finished and the wait for the buckets begins, and
``finished`` once the averages are back in ``param.grad``.  Each bucket becomes a ``comm`` span
``bucket {i}`` (with its size in bytes) and the wait a ``wait`` span.  Without a timeline every
method returns at once.

Which clock: the host's.  A bucket's span ends when its Work's future completes.  On gloo that
is when the all-reduce has finished; on nccl the future completes when the collective is
*enqueued* on the GPU stream, so the span measures the launch, not the transfer: time GPU work
with CUDA events or the profiler instead.
"""

from __future__ import annotations

from .timeline import Timeline


class BucketTrace:
    def __init__(self, timeline: Timeline | None):
        self.timeline = timeline
        self._launched_ms: dict[int, float] = {}
        self._done_ms: dict[int, float] = {}
        self._waiting_ms = 0.0

    def launched(self, bucket) -> None:
        if self.timeline is None:
            return
        self._launched_ms[bucket.index] = self.timeline.now()
        self._done_ms.pop(bucket.index, None)
        done, now, index = self._done_ms, self.timeline.now, bucket.index

        def record(_future) -> None:  # on the communication thread, when the bucket is done
            done[index] = now()
        bucket.work.get_future().add_done_callback(record)

    def waiting(self) -> None:
        if self.timeline is not None:
            self._waiting_ms = self.timeline.now()

    def finished(self, launched_buckets) -> None:
        if self.timeline is None:
            return
        now = self.timeline.now()
        self.timeline.add("wait for buckets", "wait", self._waiting_ms, now)
        for bucket in launched_buckets:
            self.timeline.add(f"bucket {bucket.index}", "comm", self._launched_ms[bucket.index],
                              self._done_ms.get(bucket.index, now), bytes=bucket.nbytes)

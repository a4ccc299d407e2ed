"""BucketTrace: BucketedDDP's buckets on a timeline, layered on without touching its logic.

``BucketedDDP(..., timeline=tl)`` passes one as its ``observer`` (a ``BucketObserver``: the
wrapper tells it each bucket launch and each end of backward), so the teaching code in
bucketed_ddp.py stays free of bookkeeping.  Each bucket becomes a ``comm`` span ``bucket {i}``
(with its size in bytes), and the wait at the end of backward a ``wait`` span ``wait for buckets``.

Which clock: the host's.  A bucket's span ends when its Work's future completes.  On gloo that
is when the all-reduce has finished; on nccl the future completes when the collective is
*enqueued* on the GPU stream, so the span measures the launch, not the transfer: time GPU work
with CUDA events or the profiler instead.
"""

from __future__ import annotations

from .timeline import Timeline


class BucketTrace:
    """A ``BucketObserver`` (the same four methods) that records on ``timeline``."""

    def __init__(self, timeline: Timeline):
        self.timeline = timeline
        self._launched: list[tuple[object, float]] = []  # (bucket, launch time), this pass
        self._done_ms: dict[int, float] = {}
        self._starting = self._waiting = None  # stamps: this bucket's launch, the final wait

    def bucket_launching(self, bucket) -> None:
        self._starting = self.timeline.now()

    def bucket_launched(self, bucket) -> None:
        self._launched.append((bucket, self._starting))
        self._done_ms.pop(bucket.index, None)
        done, now, index = self._done_ms, self.timeline.now, bucket.index

        def record(_future) -> None:  # on the communication thread, when the bucket is done
            done[index] = now()
        work = bucket.work  # a dist.Work, or the Future a comm hook returned
        (work.get_future() if hasattr(work, "get_future") else work).add_done_callback(record)

    def backward_finishing(self) -> None:
        self._waiting = self.timeline.now()

    def backward_finished(self) -> None:
        now = self.timeline.now()
        self.timeline.add("wait for buckets", "wait", self._waiting, now)
        for bucket, started in self._launched:
            self.timeline.add(f"bucket {bucket.index}", "comm", started,
                              self._done_ms.get(bucket.index, now), bytes=bucket.nbytes)
        self._launched.clear()

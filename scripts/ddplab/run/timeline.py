"""Timelines: what each rank was doing, when — recorded, drawn, and exported for Perfetto.

Each rank records spans (forward, backward, one bucket's all-reduce, a wait…) against its own
clock, started right after a barrier so that all ranks share a time origin to within the
barrier's skew (microseconds on one machine).  Rank 0 gathers them, draws a Gantt chart, and
writes a Chrome trace (``chrome://tracing`` / https://ui.perfetto.dev open it).

Which clock: on CPU the host's (``perf_counter``): an op has finished when its call returns.
On a GPU the host only *queues* kernels, so ``Timeline(rank, device=cuda)`` stamps with CUDA
events recorded on the current stream instead: each holds the moment the GPU reached that
point of its queue, and they are turned into milliseconds when the events are read.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass
class Event:
    name: str
    cat: str  # forward, backward, comm, optimizer, wait, …: also picks the colour
    start_ms: float
    end_ms: float
    rank: int
    args: dict = field(default_factory=dict)

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


class Timeline:
    """Spans recorded on one rank, in milliseconds since ``start_clock``.

    ``device``: a CUDA device makes every stamp a CUDA event (the GPU's clock, see above);
    otherwise stamps are host times.  Either way ``now()`` returns a stamp to hand to ``add``,
    and ``events`` holds plain milliseconds.
    """

    def __init__(self, rank: int, enabled: bool = True, device: torch.device | None = None):
        self.rank = rank
        self.enabled = enabled
        self.on_gpu = device is not None and torch.device(device).type == "cuda"
        self._events: list[Event] = []
        self._pending: list[tuple] = []   # GPU: spans whose CUDA events are not read yet
        self._origin = _cuda_event() if self.on_gpu else time.perf_counter()

    def start_clock(self) -> None:
        """Make *now* time zero; call it right after a barrier, on every rank."""
        self._origin = _cuda_event() if self.on_gpu else time.perf_counter()
        self._events.clear()
        self._pending.clear()

    def now(self):
        """A stamp: milliseconds on CPU; on a GPU a CUDA event recorded on the current stream."""
        if self.on_gpu:
            return _cuda_event()
        return (time.perf_counter() - self._origin) * 1e3

    def elapsed_ms(self) -> float:
        """Milliseconds since ``start_clock``, as a number (on a GPU: waits for queued work)."""
        return self._ms(self.now())

    def add(self, name: str, cat: str, start_ms, end_ms, **args) -> None:
        """Record a span whose ends were stamped elsewhere (e.g. an async op's completion)."""
        if not self.enabled:
            return
        if self.on_gpu:
            self._pending.append((name, cat, start_ms, end_ms, args))
        else:
            self._events.append(Event(name, cat, start_ms, end_ms, self.rank, args))

    @property
    def events(self) -> list[Event]:
        """The spans so far (on a GPU reading them waits until their events have happened)."""
        for name, cat, start, end, args in self._pending:
            self._events.append(Event(name, cat, self._ms(start), self._ms(end), self.rank, args))
        self._pending.clear()
        return self._events

    @events.setter
    def events(self, events: list[Event]) -> None:
        self._pending.clear()
        self._events = events

    @contextmanager
    def span(self, name: str, cat: str, **args) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.add(name, cat, start, self.now(), **args)

    def _ms(self, stamp) -> float:
        if not self.on_gpu:
            return stamp
        stamp.synchronize()
        return self._origin.elapsed_time(stamp)


def _cuda_event():
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def gather_events(timeline: Timeline) -> list[Event] | None:
    """All ranks' events on rank 0 (None elsewhere).  A collective: every rank must call it."""
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, [asdict(e) for e in timeline.events])
    if dist.get_rank() != 0:
        return None
    return [Event(**e) for events in everything for e in events]


def chrome_trace(events: list[Event]) -> dict:
    """Chrome trace JSON: one process row per rank, one thread row per category."""
    cats = sorted({e.cat for e in events})
    trace = []
    for rank in sorted({e.rank for e in events}):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                      "args": {"name": f"rank {rank}"}})
        for tid, cat in enumerate(cats):
            trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                          "args": {"name": cat}})
    for e in events:
        trace.append({"name": e.name, "cat": e.cat, "ph": "X", "pid": e.rank,
                      "tid": cats.index(e.cat), "ts": e.start_ms * 1e3,
                      "dur": max(e.duration_ms, 0.0) * 1e3, "args": e.args})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(path: Path, events: list[Event]) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(events)))
    return path


def draw_gantt(ax, events: list[Event], *, lanes: list[str] | None = None,
               title: str | None = None, stack_lanes: bool = False) -> None:
    """One row per (rank, lane); ``lanes`` are categories drawn on separate rows (the rest
    share the rank's main row).  Colours come from ``ddplab.run.plotting.COLORS``.
    ``stack_lanes``: inside a lane, each event name (``bucket 0``, ``bucket 1``…) gets a thin
    row of its own, so that spans in flight at the same time stay visible side by side."""
    from .plotting import COLORS, OKABE_ITO

    lanes = lanes or []
    rows: list[tuple[int, str | None]] = []
    for rank in sorted({e.rank for e in events}):
        rows += [(rank, None)] + [(rank, lane) for lane in lanes]
    names = {lane: sorted({e.name for e in events if e.cat == lane}, key=_natural)
             for lane in lanes}
    height = 0.8
    for e in events:
        lane = e.cat if e.cat in lanes else None
        y, h = len(rows) - 1 - rows.index((e.rank, lane)) - height / 2, height
        if lane is not None and stack_lanes:
            h = height / len(names[lane])
            y += h * (len(names[lane]) - 1 - names[lane].index(e.name))
        ax.broken_barh([(e.start_ms, max(e.duration_ms, 1e-3))], (y, h),
                       color=COLORS.get(e.cat, OKABE_ITO["grey"]),
                       edgecolor="white" if stack_lanes and lane else None,
                       linewidth=0.5 if stack_lanes and lane else 0)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r}" + (f" {lane}" if lane else "") for r, lane in reversed(rows)])
    ax.set_xlabel("time since step start (ms)")
    ax.grid(axis="y", visible=False)
    handles = [_patch(COLORS.get(c, OKABE_ITO["grey"]), c) for c in sorted({e.cat for e in events})]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25),
              ncol=min(len(handles), 6))
    if title:
        ax.set_title(title)


def _natural(name: str) -> tuple:
    """'bucket 10' after 'bucket 9'."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part)
                 for part in name.split())


def _patch(color: str, label: str):
    from matplotlib.patches import Patch

    return Patch(color=color, label=label)

"""What the learner's code may call, and where it is waiting: installed in every rank.

Two jobs, both done by wrapping functions of ``torch.distributed`` before the learner's file is
imported (so ``from torch.distributed import all_reduce`` in that file gets the wrapper too):

* a point-to-point exercise must really use point-to-point: while its code runs, the collectives
  it rebuilds raise a ``Mistake`` that names the call and the learner's line;
* a hang must be explained: before every blocking send/recv/wait the rank writes what it is about
  to wait for (and the learner's line) into a shared buffer the grading process reads when it
  ends the hung exercise; a watcher thread keeps the learner's line the rank is running in a
  second buffer, so a hang with no message pending (a loop that never ends) is named too.
"""

from __future__ import annotations

import functools
import linecache
import sys
import threading
import time
import traceback
from contextlib import contextmanager

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single",
    "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter",
    "all_reduce_coalesced", "all_gather_object", "broadcast_object_list", "all_gather_coalesced",
)


class Mistake(Exception):
    """The learner's result is wrong; the message says how, in the learner's terms."""


class _State:
    banned: str | None = None  # the exercise id while p2p-only learner code runs
    learner_file: str = ""
    inside = False  # inside a wrapped call already
    waiting = None  # a multiprocessing Array('c') shared with the grading process


def _write(buffer, text: str) -> None:
    if buffer is not None:
        buffer.value = text.encode()[: len(buffer) - 1]


def running_line(frame, learner_file: str) -> str:
    """'your line N (`source`)' for the innermost frame of the learner's file, or ''."""
    while frame is not None and frame.f_code.co_filename != learner_file:
        frame = frame.f_back
    if frame is None:
        return ""
    source = linecache.getline(learner_file, frame.f_lineno).strip()
    return f"your line {frame.f_lineno}" + (f" (`{source}`)" if source else "")


def watch_main_thread(learner_file: str, buffer, every_s: float = 0.25) -> None:
    """Keep the learner's line the main thread is running in ``buffer`` (a daemon thread).

    A Python loop gives the thread its turn every few milliseconds (the GIL's switch interval);
    a call that holds the GIL for good leaves the last line seen, which is still the learner's."""
    main = threading.main_thread().ident

    def watch() -> None:
        last = None
        while True:
            line = running_line(sys._current_frames().get(main), learner_file)
            if line != last:
                _write(buffer, line)
                last = line
            time.sleep(every_s)

    threading.Thread(target=watch, name="grader-watch", daemon=True).start()


def learner_line() -> str:
    """' (your line N)' for the innermost frame of the learner's file on the stack, or ''."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename == _State.learner_file:
            return f" (your line {frame.lineno})"
    return ""


def _say_waiting(text: str) -> None:
    _write(_State.waiting, text)


class _WatchedWork:
    """A Work from isend/irecv whose wait() is recorded like a blocking call."""

    def __init__(self, work, what: str):
        self._work, self._what = work, what

    def wait(self, *args, **kwargs):
        _say_waiting(f"was waiting for its {self._what} to complete")
        result = self._work.wait(*args, **kwargs)
        _say_waiting("")
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def _peer_text(kind: str, args, kwargs) -> str:
    peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
    direction = "to" if "send" in kind else "from"
    return f"dist.{kind} {direction} rank {peer}" if peer is not None else f"dist.{kind}"


def _check_peer(name: str, args, kwargs) -> None:
    """A Mistake for a peer outside the group or equal to this rank: what a group rank passed
    where send/recv expect a global rank looks like (gloo itself only says "Pair is not
    connected", or torch "Global rank ... is not part of group")."""
    peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
    group = kwargs.get("group", args[2] if len(args) > 2 else None)
    if peer is None or group is None or group is dist.GroupMember.WORLD:
        return
    ranks, me = dist.get_process_group_ranks(group), dist.get_rank()
    if peer == me:
        problem = f"rank {peer} is this rank itself"
    elif peer not in ranks:
        problem = f"rank {peer} is not in that group"
    else:
        return
    raise Mistake(f"rank {me} (rank {ranks.index(me)} of the group): your code called "
                  f"{_peer_text(name, args, kwargs)}{learner_line()} with a group of global ranks "
                  f"{ranks}, and {problem}. dist.send/recv take global ranks even with a group: "
                  "translate group rank r with dist.get_global_rank(group, r)")


def _wrap_p2p(name: str, original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if _State.inside:  # torch's recv calls irecv: report the call the learner wrote
            return original(*args, **kwargs)
        _check_peer(name, args, kwargs)
        what = _peer_text(name, args, kwargs) + learner_line()
        if name in ("isend", "irecv"):
            return _WatchedWork(original(*args, **kwargs), what)
        _say_waiting(f"was waiting in {what}")
        _State.inside = True
        try:
            return original(*args, **kwargs)
        finally:
            _State.inside = False
            _say_waiting("")
    return wrapper


def _wrap_collective(name: str, original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if _State.banned is not None:
            raise Mistake(f"your code called dist.{name}{learner_line()}: exercise "
                          f"{_State.banned} builds it from send/recv, so the collectives are "
                          "switched off while it runs")
        _say_waiting(f"was waiting in dist.{name}{learner_line()}")
        result = original(*args, **kwargs)
        _say_waiting("")
        return result
    return wrapper


def install(learner_file: str, waiting) -> None:
    """Wrap torch.distributed's calls in this process (once, before importing the learner)."""
    _State.learner_file, _State.waiting = learner_file, waiting
    for name in ("send", "recv", "isend", "irecv"):
        wrapped = _wrap_p2p(name, getattr(c10d, name))
        setattr(dist, name, wrapped)
        setattr(c10d, name, wrapped)
    for name in COLLECTIVES:
        if hasattr(c10d, name):
            wrapped = _wrap_collective(name, getattr(c10d, name))
            setattr(dist, name, wrapped)
            setattr(c10d, name, wrapped)


@contextmanager
def point_to_point_only(exercise_id: str):
    """Switch the collectives off while the learner's code runs (the grader's own stay on)."""
    _State.banned = exercise_id
    try:
        yield
    finally:
        _State.banned = None

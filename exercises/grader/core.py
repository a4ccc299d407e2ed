"""Grade one learner file: launch the ranks, run every exercise's check, explain each result.

The grading process never runs the learner's code itself (a hang there would hang the grader).
It starts the ranks for one world size (1, 2, then 3), each rank imports the learner's file and
runs the checks of that world size's exercises in order; after each exercise every rank reports
a verdict and waits for a "next".  When an exercise does not finish within its timeout, or one
rank failed and the others are stuck waiting for it, the ranks are killed, the exercise is named
(with what each rank was waiting for, or the line it was running), and fresh ranks go on with
the next exercise.  Whether the file has the exercises' names is asked of a child process too
(the "probe"), which imports it under a time limit: the learner's module-level code can loop,
exit or fork there without touching the grading process.  Every such process leads its own
process group, and it is killed with everything it started (``procs.kill_trees``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import multiprocessing as mp
import os
import queue
import re
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from . import procs
from .chapters import UsageError, check_path
from .guard import Mistake, point_to_point_only

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 2.0  # how long the other ranks may take to finish once one rank has failed
IMPORT_TIMEOUT_S = 20.0  # for the learner's module-level code (torch is imported already)
LAUNCHED_PIDS: list[int] = []  # every process started for learner code, so the tests can check


def timeout_override() -> float | None:
    """GRADER_TIMEOUT_S (a slow laptop, or the tests), checked: a finite number of seconds > 0."""
    text = os.environ.get("GRADER_TIMEOUT_S")
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise UsageError(f"GRADER_TIMEOUT_S must be a number of seconds greater than 0, got "
                         f"{text!r}: unset it (`unset GRADER_TIMEOUT_S`) or set e.g. 30")
    return seconds


def timeout_of(ex: Exercise) -> float:
    """The exercise's timeout; GRADER_TIMEOUT_S overrides it."""
    override = timeout_override()
    return ex.timeout_s if override is None else override


def import_timeout() -> float:
    """How long the learner's module-level code may run; GRADER_TIMEOUT_S overrides it too."""
    override = timeout_override()
    return IMPORT_TIMEOUT_S if override is None else override


@dataclass
class Exercise:
    id: str  # "03.2"
    name: str  # the function or class the learner writes
    check: Callable[[Context], None]  # runs on every rank; raises Mistake when the result is wrong
    world_sizes: tuple[int, ...] = (2, 3)  # (1,) for an exercise that needs no other rank
    p2p_only: bool = False  # the collectives are switched off while the learner's code runs
    timeout_s: float = 15.0
    hang_hint: str = ""  # the likely cause of a hang, in the learner's terms


@dataclass
class Context:
    """What a check sees on its rank."""

    rank: int
    world_size: int
    learner: object  # the learner's module
    exercise: Exercise
    feedback: dict = field(default_factory=dict)  # rank 0's figure data, sent to the parent

    def call(self, fn, *args, **kwargs):
        """Run the learner's code (with the collectives off for a point-to-point exercise)."""
        if not self.exercise.p2p_only:
            return fn(*args, **kwargs)
        with point_to_point_only(self.exercise.id):
            return fn(*args, **kwargs)

    def gather(self, obj) -> list:
        """Every rank's ``obj``, on every rank (the grader's own collective, never banned)."""
        import torch.distributed as dist
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


@dataclass
class Verdict:
    exercise: Exercise
    status: str  # "ok", "fail", "todo", "hang", "missing", "broken" (the file cannot be loaded)
    message: str = ""
    world_size: int = 0
    feedback: dict = field(default_factory=dict)

    def line(self) -> str:
        mark = {"ok": "✓", "todo": "…"}.get(self.status, "✗")
        head = f"  {mark} {self.exercise.id} {self.exercise.name}"
        if self.status == "ok":
            return head
        if self.status == "todo":
            return f"{head}: not implemented yet"
        where = f" [{self.world_size} rank{'s' if self.world_size > 1 else ''}]" \
            if self.world_size else ""
        return f"{head}{where}: {self.message}"


# ---------------------------------------------------------------- the learner's file
def load_learner(path: Path, name: str = "learner"):
    """Import the learner's file as a module (its own name, so two files never clash)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def explain_exception(error: BaseException, path: Path) -> str:
    """One line: what was raised, and the learner's line it came from."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == str(path)]
    if isinstance(error, SyntaxError) and error.filename == str(path):
        return f"syntax error at your line {error.lineno}: {error.msg}"
    where = f" at your line {frames[-1].lineno} (`{frames[-1].line}`)" if frames else ""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"your code raised {type(error).__name__}{where}" + (f": {text}" if text else "")


def _probe_main(path: str, names: list[str], answer, where) -> None:
    """In a child process: import the learner's file and answer which names it lacks."""
    procs.own_session()
    from . import guard
    guard.watch_main_thread(path, where)
    try:
        module = load_learner(Path(path), "learner_probe")
    except BaseException as error:  # SystemExit and KeyboardInterrupt included: all the learner's
        answer.send(("error", explain_exception(error, Path(path))))
    else:
        answer.send(("ok", [name for name in names if not hasattr(module, name)]))
    answer.close()
    os._exit(0)  # nothing the learner's module registered (atexit, threads) runs or blocks


def _probe(path: Path, chapter: int, names: list[str]) -> tuple[str, object]:
    """Import the file in a child process, within import_timeout(): ("ok", missing names),
    ("error", what was raised), or ("stopped", why the import never finished)."""
    ctx = _context(chapter)
    receiving, answer = ctx.Pipe(duplex=False)
    where = ctx.Array("c", 300, lock=False)
    child = ctx.Process(target=_probe_main, args=(str(path), names, answer, where), daemon=True)
    limit = import_timeout()
    child.start()
    LAUNCHED_PIDS.append(child.pid)
    answer.close()
    try:
        if receiving.poll(limit):
            with contextlib.suppress(EOFError):
                return receiving.recv()
            child.join(timeout=5)  # the pipe closed without an answer: the process ended
            return "stopped", ("your file ended the process that imported it (exit code "
                               f"{child.exitcode}): remove the module-level exit "
                               "(os._exit, sys.exit, os.kill) and keep module-level code to "
                               "imports and definitions")
        running = where.value.decode()
        at = f", still at {running}" if running else ""
        return "stopped", (f"your file did not finish importing within {limit:.0f} s{at}: code "
                           "at module level runs on import; move it into a function (or under "
                           "`if __name__ == \"__main__\":`)")
    finally:
        procs.kill_trees([child.pid])
        child.join(timeout=10)
        receiving.close()


def precheck(path: Path, chapter: int, exercises: list[Exercise]
             ) -> tuple[dict[str, Verdict], str]:
    """Problems visible without ranks: a syntax error, a file that never imports, a missing name."""
    status, answer = _probe(path, chapter, [ex.name for ex in exercises])
    if status == "error":
        return {}, f"{path} cannot be imported: {answer}"
    if status == "stopped":
        return {}, answer
    missing = {}
    for ex in exercises:
        if ex.name in answer:
            missing[ex.id] = Verdict(ex, "missing", f"your file has no `{ex.name}`: keep the "
                                     "name and signature of the exercise file")
    return missing, ""


# ---------------------------------------------------------------- one rank
def _rank_main(rank, world, port, prefix, path, chapter, ids, to_parent, go, waiting, where):
    procs.own_session()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from . import guard
    from .chapters import load_chapter
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    guard.install(str(path), waiting)
    guard.watch_main_thread(str(path), where)
    exercises = {ex.id: ex for ex in load_chapter(chapter)}
    learner = load_learner(Path(path))
    for ex_id in ids:
        ctx = Context(rank, world, learner, exercises[ex_id])
        torch.manual_seed(1234 + rank)  # ranks start different, like real ranks do
        try:
            exercises[ex_id].check(ctx)
            to_parent.put((ex_id, rank, "ok", "", ctx.feedback))
        except NotImplementedError as error:
            to_parent.put((ex_id, rank, "todo", str(error), {}))
        except Mistake as error:
            to_parent.put((ex_id, rank, "fail", str(error), ctx.feedback))
        except BaseException as error:  # SystemExit too: the learner's code ends no rank
            to_parent.put((ex_id, rank, "fail", explain_exception(error, Path(path)), {}))
        if go.get() != "next":
            break
    os._exit(0)  # skip the teardown: the grading process decides when the group is done


# ---------------------------------------------------------------- the grading process
def _context(chapter: int):
    """Ranks fork from a server that has imported torch and the chapter's checks once, where
    that server can start: a rank then starts in a fraction of a second, not seconds."""
    from ddplab.run.fork_server import socket_fits  # with a long TMPDIR, ranks are spawned
    ctx = mp.get_context("forkserver" if socket_fits() else "spawn")
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(fork_server_preload(chapter))
    return ctx


def fork_server_preload(chapter: int) -> list[str]:
    """What the fork server imports once, so that no rank does: torch; torch._dynamo, which
    torch imports on the first optimizer or DDP a process builds (a second of CPU); and the
    grader's checks of the chapter (chapter 11's pull in FSDP and DTensor).  Never the learner's
    file: that is imported in the ranks, which the grader controls."""
    return ["torch", "torch.distributed", "torch._dynamo", f"exercises.grader.ch{chapter:02d}"]


def _worst(reports: dict[int, tuple], world: int) -> tuple[str, str, dict]:
    """The exercise's verdict from every rank's report: a failure beats a todo beats ok."""
    for status in ("fail", "todo", "ok"):
        for rank in sorted(reports):
            if reports[rank][0] == status:
                msg = reports[rank][1]
                feedback = reports.get(0, reports[rank])[2]
                if status == "fail" and not re.search(r"\brank \d", msg) and world > 1:
                    msg = f"rank {rank}: {msg}"
                return status, msg, feedback
    raise AssertionError("no report")


def _hang_message(ex: Exercise, waiting, where) -> str:
    """Which rank was where, and a hint that fits: a rank that was running the learner's code
    (waiting for no message) is the cause, however long the others waited for it."""
    stuck, busy = [], []
    for rank, (wait, line) in enumerate(zip(waiting, where, strict=True)):
        wait, line = wait.value.decode(), line.value.decode()
        if wait:
            stuck.append(f"rank {rank} {wait}")
        elif line:
            stuck.append(f"rank {rank} was running {line}")
            busy.append(str(rank))
        else:
            stuck.append(f"rank {rank} was still running")
    hint = ex.hang_hint
    if busy:
        who = f"rank {busy[0]}" if len(busy) == 1 else f"ranks {', '.join(busy)}"
        hint = (f"{who.capitalize()} waited for no message: your code itself did not return "
                "(a loop whose condition never changes?).")
    stopped = f"did not finish within {timeout_of(ex):.0f} s (stopped): "
    return stopped + "; ".join(stuck) + "." + (f" {hint}" if hint else "")


def run_world(path: Path, chapter: int, exercises: list[Exercise], world: int, store, launch_no
              ) -> dict[str, Verdict]:
    """Run ``exercises`` on ``world`` ranks, relaunching after an exercise that hung or split."""
    ctx, verdicts, todo = _context(chapter), {}, list(exercises)
    while todo:
        launch_no[0] += 1
        to_parent = ctx.Queue()
        gos = [ctx.SimpleQueue() for _ in range(world)]
        waiting = [ctx.Array("c", 300, lock=False) for _ in range(world)]
        where = [ctx.Array("c", 300, lock=False) for _ in range(world)]
        ranks = [ctx.Process(target=_rank_main, daemon=True,
                             args=(r, world, store.port, f"g{launch_no[0]}/", str(path), chapter,
                                   [ex.id for ex in todo], to_parent, gos[r], waiting[r],
                                   where[r]))
                 for r in range(world)]
        clean = True
        try:
            for p in ranks:
                p.start()
                LAUNCHED_PIDS.append(p.pid)
            while todo and clean:
                ex = todo.pop(0)
                reports = {}
                deadline = time.monotonic() + timeout_of(ex)
                while len(reports) < world:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    try:
                        _ex_id, rank, status, msg, feedback = to_parent.get(timeout=min(left, 0.5))
                    except queue.Empty:
                        if any(not p.is_alive() for p in ranks) and to_parent.empty():
                            dead = [r for r, p in enumerate(ranks) if not p.is_alive()]
                            reports.setdefault(dead[0], ("fail", "the rank's process died "
                                                         f"(exit code {ranks[dead[0]].exitcode})",
                                                         {}))
                            break
                        continue
                    reports[rank] = (status, msg, feedback)
                    if status == "fail" and len(reports) < world:  # the others may wait forever
                        deadline = min(deadline, time.monotonic() + GRACE_S)
                statuses = {r[0] for r in reports.values()}
                if len(reports) == world and statuses in ({"ok"}, {"todo"}):
                    # Every rank finished cleanly: go on in the same processes.  After a
                    # failure, fresh ranks take over instead: the failed code may have left
                    # messages in flight that the next exercise's recv would pick up.
                    status, msg, feedback = _worst(reports, world)
                    for go in gos if todo else ():  # after the last, the ranks wait to be ended
                        go.put("next")
                elif reports:
                    status, msg, feedback = _worst(reports, world)
                    clean = False
                else:
                    status, msg, feedback = "hang", _hang_message(ex, waiting, where), {}
                    clean = False
                verdicts[ex.id] = Verdict(ex, status, msg, world, feedback)
        finally:
            # Killed while still alive: what the learner's code started is still their
            # descendant (the ranks are subreapers) and in their process group.
            procs.kill_trees([p.pid for p in ranks if p.pid])
            for p in ranks:
                if p.pid:
                    p.join(timeout=10)
            to_parent.close()
            to_parent.join_thread()
    return verdicts


def grade(path: Path, chapter: int) -> list[Verdict]:
    """Every exercise of the chapter, graded on 1, 2 and 3 ranks as each one needs."""
    import torch.distributed as dist

    from .chapters import load_chapter
    exercises = load_chapter(chapter)
    path = Path(path).resolve()
    check_path(path)
    timeout_override()  # a bad GRADER_TIMEOUT_S is said before anything starts
    verdicts, problem = precheck(path, chapter, exercises)
    if problem:
        return [Verdict(ex, "broken", problem) for ex in exercises]
    # The store lives here, on a port the system picked: no race for a free port between ranks.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    launch_no = [0]
    for world in sorted({w for ex in exercises for w in ex.world_sizes}):
        pending = [ex for ex in exercises if world in ex.world_sizes and
                   (ex.id not in verdicts or verdicts[ex.id].status == "ok")]
        if pending:
            for ex_id, verdict in run_world(path, chapter, pending, world, store,
                                            launch_no).items():
                if ex_id in verdicts and not verdict.feedback:  # keep an earlier world's figure
                    verdict.feedback = verdicts[ex_id].feedback
                verdicts[ex_id] = verdict
    del store
    return [verdicts[ex.id] for ex in exercises]

"""Ending a run on every exit path: no process left running, no temporary file left behind.

A run ends in one of four ways: it finishes, a rank fails, the reader presses Ctrl-C, or
something sends SIGTERM (``kill``, a job scheduler).  The last three must end every process the
run started, at once, and the files they leave: this module is how.

* ``stop_on_sigterm()`` turns SIGTERM into an exception, so that the launching process runs its
  ``finally`` blocks (stop the ranks, remove the temporary directory) instead of vanishing.
* ``stops_held()`` holds the stop signals back while processes start, then acts on them, so
  that no process is started after a stop and left behind.
* ``find_tempdir()`` finds the temporary directory while stops are held: tempfile's search
  writes a probe file there and removes it, and a Ctrl-C between the two would leave it behind.
* ``stop_processes(procs)`` ends processes we started: SIGTERM, a short grace, then SIGKILL —
  a stopped (SIGSTOP) or stuck process ignores SIGTERM until it runs again, SIGKILL it does not.
* ``run_to_end(argv)`` runs a child script; stopped, it gets SIGTERM and a grace to clean up.
* ``end_process_tree(popen)`` ends a subprocess and everything under it (torchrun starts each
  rank in a session of its own, so its process group alone does not reach them).
* ``exit_without_teardown(code)`` ends a rank's process once its work is handed over, without
  the interpreter's teardown, which can abort after the work is done.
* ``flush_resource_tracker()`` makes multiprocessing's resource tracker say what it has to say
  (warnings about semaphores a killed rank never released) *before* our last line, not after.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable

from .node_guard import descendants  # standard library only: the guard runs it alone

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE_S = 2.0  # how long a process gets to end by itself after SIGTERM
CHILD_GRACE_S = 15.0  # a chapter script stopping its ranks: up to 2 * STOP_GRACE_S, and imports


class Stopped(KeyboardInterrupt):
    """The run was stopped from outside by a signal; the message names it."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.exit_code = 128 + signum  # what a shell reports for a process the signal ended


def stop_on_sigterm() -> None:
    """From now on SIGTERM (and SIGHUP: the terminal closed) raises ``Stopped`` here."""
    def stop(signum, frame):
        raise Stopped(signum)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


@contextlib.contextmanager
def stops_held():
    """Hold back Ctrl-C, SIGTERM and SIGHUP for the block; at its end, act on any that came.

    Processes started in the block inherit the blocked signals (``pthread_sigmask``): a Ctrl-C
    while a rank still imports torch waits until the rank ignores SIGINT, instead of printing a
    traceback from the middle of that import.  But the mask is this thread's only: the kernel
    gives a signal to any thread that does not block it (a TCPStore's server thread, torch's
    worker threads), and Python runs the handler in the main thread all the same, in the middle
    of the block.  So the handlers are swapped too, for one that only notes the signal.
    """
    noted: list[int] = []
    swap = threading.current_thread() is threading.main_thread()  # handlers live there only
    previous = {sig: signal.signal(sig, lambda signum, _: noted.append(signum))
                for sig in STOP_SIGNALS} if swap else {}
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # pending ones are noted now
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(noted):  # once each, with the handlers the run had
            signal.raise_signal(signum)


def find_tempdir() -> None:
    """Find (and cache) the temporary directory now, with the stop signals held.  tempfile
    finds it on first use by writing a probe file there and removing it; a Ctrl-C between the
    two would leave the probe behind (a file with an 8-letter name in TMPDIR)."""
    with stops_held():
        tempfile.gettempdir()


def stop_processes(procs: Iterable, grace: float = STOP_GRACE_S) -> None:
    """End multiprocessing ``Process`` objects that are still alive; wait until they are gone."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()  # SIGTERM
    deadline = time.monotonic() + grace
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()  # SIGKILL: also ends a stopped or stuck process
        p.join()


def run_to_end(argv: list[str], env: dict, timeout: float) -> tuple[int, str]:
    """Run ``argv`` to its end: (exit code, its output).  If we are stopped meanwhile (Ctrl-C,
    SIGTERM, ``timeout``), it gets SIGTERM and a grace to stop its ranks and remove its files
    (SIGKILL, what ``subprocess.run`` sends, would leave them), then SIGKILL."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException as err:
        # Ctrl-C in a terminal reached the child too: give it a moment to stop by itself
        # (a second signal would cut its clean-up short); otherwise it is told now.
        if isinstance(err, KeyboardInterrupt) and not isinstance(err, Stopped):
            _wait_quietly(proc, STOP_GRACE_S)
        proc.terminate()
        if not _wait_quietly(proc, CHILD_GRACE_S):
            proc.kill()
            proc.wait()
        raise
    return proc.returncode, out


def _wait_quietly(proc: subprocess.Popen, seconds: float) -> bool:
    """Whether ``proc`` ended within ``seconds``."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def end_process_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` (started with ``start_new_session=True``) and all its descendants.

    The group is frozen first (SIGSTOP), so that nobody starts a new process (torchrun
    restarting its workers) while we list who is there.
    """
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGSTOP)
    for pid in [*descendants(proc.pid), proc.pid]:
        for kill in (os.killpg, os.kill):  # its process group (torchrun's ranks have their own)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)
    proc.wait()


def flush_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker now (if this process started one).

    It warns about (and cleans up) semaphores that a killed rank never released — when it
    stops, which would otherwise be after our last line, as the interpreter exits.
    """
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    if getattr(tracker, "_fd", None) is not None:
        with contextlib.suppress(Exception):  # _stop: private, but there since Python 3.8
            tracker._stop()


def exit_without_teardown(code: int) -> None:
    """End a rank's process now that it has left the group and handed over its result.

    What a normal exit does first still happens: threads the worker left running (a writer
    thread, say) are waited for, and the ``atexit`` handlers run (they flush logs and release
    what ``multiprocessing`` made, such as tqdm's lock).  What is skipped is the teardown.  A
    rank's teardown can crash, rarely: ``terminate called without an active exception``,
    SIGABRT, after the work was done (pytorch#190489).  A process group's C++ thread lets go
    of a tensor during the teardown and needs the GIL, which a shutting-down Python refuses by
    ending the thread, which C++ turns into ``std::terminate``.

    The group itself must not be freed either, so ``_run_rank`` keeps it past
    ``destroy_process_group``: a comm hook's future callback can hold the group's last
    reference, and if the group's own thread drops it, the thread joins itself
    (``std::system_error``, "Resource deadlock avoided", SIGABRT while the atexit handlers
    run).  Until torch._dynamo was imported before the group existed (the tests' fork server
    preloads it), ``torch.distributed.nn`` kept the group by accident: its functions take
    ``group=group.WORLD`` as a default, evaluated when DDP first imports the module.
    """
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

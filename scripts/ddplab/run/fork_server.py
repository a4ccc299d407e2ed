"""Where the ranks a script starts come from: fresh interpreters, or forks of one that is ready.

A spawned rank is a fresh Python that imports torch, the script and, once it builds a model and
an optimizer, torch._dynamo: a few CPU-seconds before its first line of work, paid again by
every rank of every launch.  A script may launch many times, so on Linux the ranks that
compute on the CPU are forked instead from multiprocessing's *fork server*:
one process that imported all of that once, at the first launch (``start_method="forkserver"``,
the default start method of Python 3.14 on Linux).

Forked ranks get the server's environment, not the one the script has at the launch; a script
that changes a variable between launches (``TORCH_DISTRIBUTED_DEBUG``, read when
torch.distributed is imported) gets a new server.  Ranks on a GPU are always spawned: CUDA cannot
be used in a process forked after CUDA was set up, and nothing here is allowed to find out
whether the server did.  macOS and Windows keep spawn too (fork is unsafe or missing there).

``forked_ranks()`` turns this on for one block: ``run_main`` wraps a chapter's main in it, and
the server it started is stopped at the block's end.  Outside the block (a test that launches
in its own process, next to a fork server of its own) ranks are spawned.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from multiprocessing import forkserver

PRELOAD = ["__main__", "torch._dynamo"]  # the script, torch through it, and what DDP imports
# The server listens on a Unix socket at $TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, and a socket's
# path holds at most 103 bytes on macOS (107 on Linux): with a longer TMPDIR, ranks are spawned.
SOCKET_PATH_MAX = 103
SOCKET_NAME_LEN = len("/pymp-XXXXXXXX/listener-XXXXXXXX")
_ours: dict = {"on": False, "environment": None}  # environment: what our running server has


@contextlib.contextmanager
def forked_ranks() -> Iterator[None]:
    """Within the block, CPU ranks on Linux are forked from a fork server this module owns."""
    if not sys.platform.startswith("linux") or not _pidfd_works() or _running():
        yield  # spawned ranks; _running(): a server of someone else's, preloaded for its needs
        return
    _ours["on"] = True
    try:
        yield
    finally:
        _ours["on"] = False
        _stop()


def start_method(device_type: str) -> str:
    """How ranks that compute on ``device_type`` are started in this process now."""
    return "forkserver" if _ours["on"] and device_type == "cpu" and socket_fits() else "spawn"


def socket_fits() -> bool:
    """Whether a fork server's socket path fits under this process's TMPDIR."""
    return sys.platform != "win32" and \
        len(os.fsencode(tempfile.gettempdir())) + SOCKET_NAME_LEN <= SOCKET_PATH_MAX


def ensure_running() -> None:
    """Have a fork server running.  Ours (inside ``forked_ranks``) has this process's
    environment and working directory as they are now; a server someone else started (a test
    that preloaded its own) is left as it is.

    Ours starts with Ctrl-C blocked: it would otherwise die of it with a traceback while it
    imports torch; it ignores Ctrl-C once ready (the pending one is then dropped), as a spawned
    rank does once started.  SIGTERM is left alone: it ends the server quietly.
    """
    if not _ours["on"]:
        forkserver.ensure_running()
        return
    wanted = (os.getcwd(), dict(os.environ))
    if _ours["environment"] == wanted and _running():
        return
    _stop()
    multiprocessing.set_forkserver_preload(PRELOAD)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    _ours["environment"] = wanted


def end_with(launcher_pid: int) -> None:
    """In a forked rank: SIGKILL this process when the script that launched it ends.

    A spawned rank asks the kernel for that (a parent-death signal); a forked rank's parent is
    the server, which stays up as long as a rank holds its pipe.  So a thread waits on the
    script's pidfd (Linux 5.3+) and kills the rank when the script is gone, SIGKILLed included.
    """
    try:
        pidfd = os.pidfd_open(launcher_pid)
    except ProcessLookupError:  # the script is already gone
        os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        select.select([pidfd], [], [])  # readable once the process has ended
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="ddplab-ends-with-its-launcher", daemon=True).start()


def _pidfd_works() -> bool:
    """Whether a rank can watch its script (``end_with``): Linux 5.3 or later."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


def _running() -> bool:
    return forkserver._forkserver._forkserver_pid is not None


def _stop() -> None:
    """Stop our server, if there is one, and whatever it forked that is still running: a rank
    holds the server's pipe too, and the server would wait for it (its ranks die with it)."""
    if _ours["environment"] is not None and _running():
        with contextlib.suppress(ProcessLookupError):
            os.kill(forkserver._forkserver._forkserver_pid, signal.SIGTERM)
        forkserver._forkserver._stop()  # reaps it, removes its socket
    _ours["environment"] = None

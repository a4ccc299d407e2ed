"""Run a command inside an emulated node, and end it (and everything it started) when the
process that launched the node dies, even by SIGKILL, which leaves that process no time to.

    python -I node_guard.py LAUNCHER_PID COMMAND...

Without it, torchrun and its ranks inside a namespace outlive a killed launcher until their
own timeouts.  The kernel tells this guard at once (``prctl(PR_SET_PDEATHSIG)``: a signal
when the parent *thread* that started us ends, so the launcher must start it from its main
thread); a check of the parent's PID covers a launcher that died before the guard could ask.
Standard library only, and run with ``-I``: it starts in a moment and imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 0.2
_told_to_stop: list[int] = []  # a flag, not an exception: a signal may land inside Popen


def _on_stop(signum, frame):
    _told_to_stop.append(signum)


def descendants(root: int) -> list[int]:
    """PIDs of every process below ``root``, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after "(comm)": state ppid
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _end_tree(child: subprocess.Popen) -> None:
    """SIGKILL the command and everything below it; freeze it first so that it starts no new
    process (torchrun restarting its ranks) while we list who is there."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(child.pid, signal.SIGSTOP)
    for pid in [*descendants(child.pid), child.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    child.wait()


def main(argv: list[str]) -> int:
    launcher, command = int(argv[0]), argv[1:]
    signal.signal(signal.SIGTERM, _on_stop)  # the launcher's death, or close() ending the node
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher:
        return 1  # the launcher died before we asked to be told
    child = subprocess.Popen(command)
    while child.poll() is None:
        if _told_to_stop or os.getppid() != launcher:
            _end_tree(child)
            return 128 + signal.SIGTERM
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=POLL_S)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Keeping every process the learner's code starts on a leash, and ending all of them.

Each process that runs learner code (the import probe, every rank) calls ``own_session()`` first:

* its own session, so its whole process group can be killed at once, and a Ctrl-C typed in the
  terminal reaches only the grading process, which then decides what to end;
* a child subreaper (Linux): a process the learner's code started, whose parent has exited,
  is re-parented to this one instead of to init, so it stays findable as a descendant even
  after ``setsid()`` took it out of the group;
* a parent-death signal: if the grading process's fork server disappears (the grading process
  was SIGKILLed), the rank is killed too instead of spinning on.

``kill_trees(pids)`` then ends the processes, every descendant and every process group they lead.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def become_subreaper() -> None:
    """Adopt the orphans of this process's descendants (Linux; elsewhere nothing happens)."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def own_session() -> None:
    """Lead a new session and process group, adopt orphans, and die with the parent."""
    with contextlib.suppress(OSError):  # already a group leader: keep it
        os.setsid()
    become_subreaper()
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _parents() -> dict[int, int]:
    """pid -> parent pid, for every process visible in /proc (empty where there is none)."""
    parents = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError), \
                    open(f"/proc/{entry}/stat") as stat:
                parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
    return parents


def descendants(roots: list[int]) -> set[int]:
    """Every live process below ``roots`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal_all(pids, groups, sig) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    for group in groups:  # a group exists only while a member lives; ESRCH once it is empty
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)


def kill_trees(roots: list[int]) -> None:
    """SIGKILL ``roots``, all their descendants and the process groups the roots lead.

    The tree is stopped first (SIGSTOP) and looked at again, so a process that forks while it is
    being killed cannot leave a child behind."""
    roots = [pid for pid in roots if pid and pid != os.getpid()]
    if not roots:
        return
    groups = [pid for pid in roots if _leads_group(pid)]
    tree = set(roots) | descendants(roots)
    _signal_all(tree, groups, signal.SIGSTOP)
    tree |= descendants(list(tree))
    _signal_all(tree, groups, signal.SIGKILL)


def _leads_group(pid: int) -> bool:
    """Whether ``pid`` leads its own process group (a rank that got as far as ``own_session``).

    A process that died before calling it leads no group, and its pid is no group's id."""
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return True  # gone already: its group, if it had one, may still have members

"""A chapter's main: every failure as one clear last line and an exit code.

``run_main(main)`` is what every chapter script ends with (``sys.exit(ddplab.run_main(main))``):
a rank that failed, bad flags, SIGTERM and Ctrl-C each end as one ``error: ...`` line on stderr
(after anything else the run prints) and a non-zero exit code, never a wall of tracebacks.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable
from typing import Any

from . import fork_server, stopping
from .cli import UsageError, show_warnings_as_one_line
from .launch import RankFailed, started_by_torchrun
from .stopping import exit_without_teardown


def run_main(main: Callable[[list[str] | None], Any], argv: list[str] | None = None) -> int:
    """Run a chapter's ``main`` and turn failures into one clear last line and an exit code."""
    show_warnings_as_one_line()
    if not started_by_torchrun():  # a rank under torchrun leaves SIGTERM to torchrun
        stopping.stop_on_sigterm()
    try:
        stopping.find_tempdir()
        with fork_server.forked_ranks():
            main(argv)
    except RankFailed as err:
        if err.details:
            sys.stderr.write(f"\n--- traceback from rank {err.rank} ---\n{err.details}\n")
        return _last_line(f"error: {err}{_timeout_hint(str(err))}", 1)
    except UsageError as err:
        return _last_line(f"error: {err}", 2)
    except stopping.Stopped as err:
        return _last_line(f"error: {err}; every rank was stopped", err.exit_code)
    except KeyboardInterrupt:
        return _last_line("error: interrupted (Ctrl-C); every rank was stopped", 130)
    except OSError as err:
        if err.errno not in NO_ROOM:
            raise
        where = err.filename or "a file"
        return _last_line(f"error: cannot write {where}: {err.strerror}; free some space there, "
                          "or write elsewhere (--out DIR, --ckpt-dir DIR, TMPDIR=DIR)", 1)
    if started_by_torchrun():
        exit_without_teardown(0)  # this process is a rank: see exit_without_teardown
    return 0


NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # disk full, over quota, file too large


def _last_line(message: str, code: int) -> int:
    """Print ``message`` after anything else this run has to say (the resource tracker's
    warnings about what a killed rank left), so that it is the line the reader sees last."""
    stopping.flush_resource_tracker()
    sys.stdout.flush()
    print(message, file=sys.stderr)
    return code


def _timeout_hint(summary: str) -> str:
    """A collective that timed out names the rank that waited, not the one that never came."""
    if "timed out" not in summary.lower():
        return ""
    return (" — another rank did not arrive within --timeout (it hung, froze or is too slow: "
            "look at what it was doing, or raise --timeout)")

"""`python -m exercises.grader NN [FILE]`: grade a chapter's exercises and print one line each.

Feedback figures go to out/feedback/ (ignored by git); `--refresh-reference` grades the reference
solution instead and rewrites the committed copies in exercises/feedback/.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

# Only light modules here: torch is imported once the signal handlers are in place, so a
# Ctrl-C during that import is one line too.
from . import procs
from .chapters import EXERCISES_DIR, SLUGS, UsageError, check_path, learner_file, solution_file

REFERENCE_FIGURES = EXERCISES_DIR / "feedback"
LEARNER_FIGURES = EXERCISES_DIR.parent / "out" / "feedback"
SIGNAL_LINES = {signal.SIGINT: "error: interrupted (Ctrl-C); every rank was stopped",
                signal.SIGTERM: "error: stopped by SIGTERM; every rank was stopped"}


class Stopped(BaseException):
    """SIGINT or SIGTERM arrived: unwind (ending the ranks on the way), then say so."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop_on_signal(signum, _frame) -> None:
    for sig in SIGNAL_LINES:  # a second signal must not cut the clean-up short
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


def find_tempdir() -> None:
    """Find (and cache) the temporary directory with the stop signals blocked.  tempfile finds it
    on first use by writing a probe file there and removing it; a Ctrl-C between the two would
    leave the probe behind.  No thread but this one runs yet: the mask alone holds them back."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNAL_LINES)
    try:
        tempfile.gettempdir()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a signal that came is acted on now


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="make grade-NN", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chapter", type=int, choices=sorted(SLUGS), metavar="NN")
    parser.add_argument("file", nargs="?", help="the file to grade (default: your exercise file)")
    parser.add_argument("--figures", type=Path, help="where feedback figures go (default: "
                        "out/feedback/; exercises/feedback/ with --refresh-reference)")
    parser.add_argument("--refresh-reference", action="store_true",
                        help="grade the reference solution and rewrite the committed feedback "
                             "figures in exercises/feedback/")
    args = parser.parse_args(argv)
    if args.refresh_reference and args.file:
        parser.error("--refresh-reference grades the reference solution: give no FILE")
    return args


def report(args: argparse.Namespace) -> int:
    """Grade, print one line per exercise and the summary; 0 only when every exercise passed."""
    path = solution_file(args.chapter) if args.refresh_reference else \
        Path(args.file) if args.file else learner_file(args.chapter)
    figures_dir = args.figures or (REFERENCE_FIGURES if args.refresh_reference
                                   else LEARNER_FIGURES)
    shown = os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd()) else path
    check_path(Path(shown))
    print(f"Grading {shown} (chapter {args.chapter:02d}; gloo on CPU, 1 to 3 ranks)", flush=True)
    from .core import grade
    from .feedback import draw_feedback
    start = time.perf_counter()
    verdicts = grade(path, args.chapter)
    if verdicts[0].status == "broken":  # one line, not one per exercise
        print(f"  ✗ {verdicts[0].message}")
    else:
        for verdict in verdicts:
            print(verdict.line(), flush=True)
    for figure in draw_feedback(args.chapter, verdicts, figures_dir):
        shown = os.path.relpath(figure) if figure.resolve().is_relative_to(Path.cwd()) \
            else figure
        print(f"  feedback figure: {shown}")
    passed = sum(v.status == "ok" for v in verdicts)
    todo = sum(v.status == "todo" for v in verdicts)
    summary = f"{passed} of {len(verdicts)} exercises pass ({time.perf_counter() - start:.1f} s)"
    if verdicts and passed == len(verdicts):
        print(f"{summary}. Well done!")
        return 0
    rest = f"; {todo} not implemented yet" if todo else ""
    print(f"{summary}{rest}. Fix the first ✗ or … above, then run the grader again.")
    return 1


def end_helpers() -> None:
    """End every process below this one (a rank that outlived an interrupted clean-up, an
    orphan adopted as a subreaper), then multiprocessing's fork server and resource tracker,
    which would outlive a signal; the tracker waits for every holder of its pipe to exit."""
    from multiprocessing import forkserver, resource_tracker
    helpers = {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid}
    procs.kill_trees([pid for pid in procs.descendants([os.getpid()]) if pid not in helpers])
    forkserver._forkserver._stop()
    resource_tracker._resource_tracker._stop()


def main(argv: list[str] | None = None) -> int:
    for sig in SIGNAL_LINES:
        signal.signal(sig, _stop_on_signal)
    procs.become_subreaper()
    last = ""
    try:
        find_tempdir()
        args = parse(argv)
        from .core import timeout_override
        timeout_override()
        code = report(args)
    except UsageError as error:
        code, last = 2, f"error: {error}"
    except Stopped as stop:
        code, last = 128 + stop.signum, SIGNAL_LINES[stop.signum]
    for sig in SIGNAL_LINES:
        signal.signal(sig, signal.SIG_IGN)
    # The unwound frames are gone now: their queues give their semaphores back before the
    # resource tracker stops (else it reports them as leaked).
    gc.collect()
    end_helpers()
    if last:  # after the clean-up: only then is it true
        sys.stdout.flush()
        print(last, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""`python -m exercises.grader NN [FILE]`: grade a chapter's exercises and print one line each."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .chapters import SLUGS, learner_file
from .core import grade
from .feedback import draw_feedback


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make grade-NN", description=__doc__)
    parser.add_argument("chapter", type=int, choices=sorted(SLUGS), metavar="NN")
    parser.add_argument("file", nargs="?", help="the file to grade (default: your exercise file)")
    parser.add_argument("--figures", default="exercises/feedback",
                        help="where feedback figures go (default: %(default)s)")
    args = parser.parse_args(argv)
    path = Path(args.file) if args.file else learner_file(args.chapter)
    shown = os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd()) else path
    print(f"Grading {shown} (chapter {args.chapter:02d}; gloo on CPU, 1 to 3 ranks)", flush=True)
    start = time.perf_counter()
    verdicts = grade(path, args.chapter)
    if verdicts[0].status == "broken":  # one line, not one per exercise
        print(f"  ✗ {verdicts[0].message}")
    else:
        for verdict in verdicts:
            print(verdict.line(), flush=True)
    figures = draw_feedback(args.chapter, verdicts, Path(args.figures))
    passed = sum(v.status == "ok" for v in verdicts)
    todo = sum(v.status == "todo" for v in verdicts)
    for figure in figures:
        print(f"  feedback figure: {figure}")
    summary = f"{passed} of {len(verdicts)} exercises pass ({time.perf_counter() - start:.1f} s)"
    if passed == len(verdicts):
        print(f"{summary}. Well done!")
        return 0
    rest = f"; {todo} not implemented yet" if todo else ""
    print(f"{summary}{rest}. Fix the first ✗ or … above, then run the grader again.")
    return 1


if __name__ == "__main__":
    sys.exit(main())

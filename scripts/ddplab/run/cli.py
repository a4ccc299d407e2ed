"""The flags every chapter script shares, and bad input turned into one clear line.

Every chapter takes the same five flags (``--world-size``, ``--backend``, ``--quick``, ``--out``,
``--seed``) plus ``--timeout`` and ``--replot``.  A mistake on the command line ends the run
before any process is started: one line on stderr that says what is wrong and what to do, exit
code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_TIMEOUT_S = 120.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week; timedelta overflows long before infinity
DEFAULT_OUT = "out"  # ignored by git: a reader's runs never touch the committed figures/
# Below this the ranks give up while still connecting to the store, before any work starts.
MIN_TIMEOUT_S = 1.0
# numpy's legacy seeding takes 0 .. 2**32 - 1; torch's and Python's take more.
MAX_SEED = 2**32 - 1
# What one CPU rank of these chapters takes (interpreter, torch, gloo, a small model), an
# estimate from measured runs; a GPU rank's host memory is larger still.
RANK_MEMORY_MIB = 220


class UsageError(Exception):
    """A problem with what the reader asked for; the message is the one line they will see."""


class ChapterArgumentParser(argparse.ArgumentParser):
    """argparse, but an error is a single line instead of a usage dump."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive(kind: type[int] | type[float]):
    """An argparse ``type`` for a flag that must be above zero; a bad value is one clear line."""
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    convert.__name__ = kind.__name__  # argparse names the type in its messages
    return convert


def chapter_parser(doc: str | None, prog: str | None = None) -> ChapterArgumentParser:
    """A parser with the shared flags; a chapter adds its own flags to it."""
    description, _, epilog = (doc or "").strip().partition("\n")
    parser = ChapterArgumentParser(
        prog=prog,
        description=description,
        epilog=epilog.strip() or None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--world-size", type=int, default=None, metavar="N",
        help="number of ranks (default: the number of GPUs if there are at least 2, else 2 CPU "
             "processes; under torchrun, torchrun's world size)",
    )
    parser.add_argument(
        "--backend", choices=BACKENDS, default="auto",
        help="auto: nccl with one GPU per rank when there are enough GPUs, else gloo",
    )
    parser.add_argument(
        "--device", choices=DEVICES, default="auto",
        help="auto: the GPUs when there are any (a 1-GPU box shares its GPU over gloo), else the "
             "CPU; --backend gloo alone keeps the CPU",
    )
    parser.add_argument("--quick", action="store_true",
                        help="small sizes, under a minute on a 2-core laptop (what the tests run)")
    # A reader's run goes to the ignored out/, so `git status` stays clean; `make figures` passes
    # --out figures to refresh the committed reference that the site shows.
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), metavar="DIR",
                        help=f"where figures and results.json go (default: {DEFAULT_OUT}; the "
                             "committed reference is figures/, refreshed by `make figures`)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
        help="how long a rank waits in a collective before the run is declared hung "
             f"(default: {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument("--replot", action="store_true",
                        help="only redraw the figures from DIR/chapterNN/results.json (and the "
                             "files beside it) of an earlier run; starts no rank")
    return parser


def parse_chapter_args(parser: argparse.ArgumentParser, argv: list[str] | None = None):
    """Parse and check the shared flags; exits with one line on bad input."""
    args = parser.parse_args(argv)
    try:
        check_launcher_environment()
        check_args(args)
        chapter = re.match(r"chapter(\d{2})_", parser.prog or "")
        if chapter:
            check_output_place(args.out, int(chapter.group(1)))
    except UsageError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    return args


def with_changes(args: argparse.Namespace, **changes) -> argparse.Namespace:
    """A copy of the parsed flags with some changed (another launch of the same chapter: a
    sub-run at another world size, a stage); ``args`` itself stays as it is."""
    return argparse.Namespace(**{**vars(args), **changes})


def check_args(args: argparse.Namespace) -> None:
    """Reject what cannot work before any process is started."""
    if args.world_size is not None and args.world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {args.world_size}")
    for name, value in vars(args).items():  # every float flag, the chapter's own ones too
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number, got {value}")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout:g}")
    if args.timeout < MIN_TIMEOUT_S:
        raise UsageError(f"--timeout {args.timeout:g} is too short: the ranks need about "
                         f"{MIN_TIMEOUT_S:g} s just to meet; use --timeout {MIN_TIMEOUT_S:g} "
                         "or more")
    if args.timeout > MAX_TIMEOUT_S:
        raise UsageError(f"--timeout {args.timeout:g} is more than a week; use at most "
                         f"{MAX_TIMEOUT_S:g} seconds")
    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed must be between 0 and {MAX_SEED} (numpy's limit), "
                         f"got {args.seed}")
    check_memory(args.world_size)
    cores = os.cpu_count() or 1
    if args.world_size is not None and args.world_size > cores and args.backend != "nccl":
        warnings.warn(
            f"{args.world_size} ranks on {cores} CPU cores: ranks will take turns on the cores, "
            "so timings will be slower and noisier than on real hardware",
            stacklevel=2,
        )
    check_writable(args.out)


RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # all three: a rank started by torchrun
# torchrun's agent sets these for every worker beside RANK/WORLD_SIZE/LOCAL_RANK
# (torch/distributed/elastic/agent/server/local_elastic_agent.py, _start_workers); a launch by
# hand for init_method="env://" sets MASTER_ADDR and MASTER_PORT.
FROM_TORCHRUN = ("TORCHELASTIC_RUN_ID", "GROUP_RANK")


def check_launcher_environment() -> None:
    """RANK, WORLD_SIZE and LOCAL_RANK, when all set, must be usable numbers that a launcher set.

    Left over in a shell (an ``export`` for an earlier experiment), they would make this run
    one rank of a torchrun job that does not exist: it would wait the whole --timeout for its
    peers and never say why.
    """
    if not all(name in os.environ for name in RANK_VARIABLES):
        return
    values = {name: _whole_number(name) for name in (*RANK_VARIABLES, "LOCAL_WORLD_SIZE")
              if name in os.environ}
    world = values["WORLD_SIZE"]
    if world < 1:
        raise UsageError(f"WORLD_SIZE={world} in the environment: a world needs at least 1 rank")
    if not 0 <= values["RANK"] < world:
        raise UsageError(f"RANK={values['RANK']} in the environment: WORLD_SIZE={world} has "
                         f"ranks 0..{world - 1}")
    local_world = values.get("LOCAL_WORLD_SIZE", world)
    if local_world < 1 or not 0 <= values["LOCAL_RANK"] < local_world:
        raise UsageError(f"LOCAL_RANK={values['LOCAL_RANK']} in the environment does not fit "
                         f"LOCAL_WORLD_SIZE={local_world}")
    by_hand = "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ
    if not by_hand and not any(name in os.environ for name in FROM_TORCHRUN):
        raise UsageError("RANK/WORLD_SIZE are set but not by torchrun (no TORCHELASTIC_RUN_ID, "
                         "no MASTER_ADDR/MASTER_PORT): unset them (unset RANK WORLD_SIZE "
                         "LOCAL_RANK) or run under torchrun")


def _whole_number(name: str) -> int:
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{name}={text!r} in the environment is not a whole number: unset "
                         "it, or run under torchrun, which sets it") from None


def check_memory(world_size: int | None) -> None:
    """Refuse more ranks than the free memory holds: otherwise the machine swaps or the
    kernel's OOM killer ends ranks (or something else) half-way through."""
    available = available_memory_mib()
    if world_size is None or available is None:
        return
    needed = world_size * RANK_MEMORY_MIB
    if needed > available:
        fits = max(1, available // RANK_MEMORY_MIB)
        raise UsageError(f"--world-size {world_size} needs about {needed} MiB (about "
                         f"{RANK_MEMORY_MIB} MiB per rank) but {available} MiB are available "
                         f"(MemAvailable in /proc/meminfo): use --world-size {fits} or fewer")


def available_memory_mib() -> int | None:
    """MemAvailable from /proc/meminfo in MiB; None where there is no such file (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024  # the file says kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_writable(out: Path) -> None:
    """Fail now, not after a long run, if the output directory cannot be written."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-check-"):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise UsageError(
            f"cannot write to --out {str(out)!r} ({reason}); choose a directory you can write to"
        ) from None


def check_output_place(out: Path, chapter: int) -> None:
    """``out/chapterNN`` must be a directory (or absent), with no directory where a file goes."""
    place = Path(out) / f"chapter{chapter:02d}"
    if place.exists() and not place.is_dir():
        raise UsageError(f"{place} is a file, where this chapter writes its figures: move it, "
                         "or choose another --out")
    if (place / "results.json").is_dir():
        raise UsageError(f"{place / 'results.json'} is a directory, where this chapter writes "
                         "its results: move it, or choose another --out")


def show_warnings_as_one_line() -> None:
    """Print a warning as 'warning: ...' instead of Python's file:line format."""
    def one_line(message, category, filename, lineno, file=None, line=None):
        print(f"warning: {message}", file=file or sys.stderr)
    warnings.showwarning = one_line

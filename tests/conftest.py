"""Shared helpers for the tests: run a chapter script the way a reader would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import chapters  # scripts/chapters.py, the chapter registry

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# The suite's processes write their temporary files into one directory of its own, removed when
# the suite ends: `torchrun --standalone` leaves a torchelastic_* directory behind on every run
# (torch never removes it), 7 per suite.  Tests that check what a run leaves still give
# that run a fresh TMPDIR of its own; pytest's tmp_path directories stay where they were.
SUITE_TMPDIR = "DDPLAB_SUITE_TMPDIR"
_MADE_HERE = pytest.StashKey[str]()


def pytest_configure(config) -> None:
    if os.environ.get(SUITE_TMPDIR):  # a pytest-xdist worker: its controller made it
        return
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())  # pytest's own dirs
    made = tempfile.mkdtemp(prefix="ddpt-")  # short: a fork server's socket path goes in it
    os.environ[SUITE_TMPDIR] = os.environ["TMPDIR"] = made
    tempfile.tempdir = None  # this process, too, asks again
    config.stash[_MADE_HERE] = made


@pytest.fixture
def short_tmp_path():
    """A tmp_path short enough for a fork server's socket under it, as /tmp is for a reader:
    pytest's own (/tmp/pytest-of-USER/pytest-N/popen-gwK/<test name>) would make a script
    spawn its ranks where a reader's forks them (ddplab.run.fork_server.socket_fits)."""
    path = Path(tempfile.mkdtemp(prefix="t-", dir=os.environ[SUITE_TMPDIR]))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def pytest_unconfigure(config) -> None:
    made = config.stash.get(_MADE_HERE, None)
    if made:
        if "multiprocessing.util" in sys.modules:  # TEST_WORKERS=0: this process forked ranks
            # multiprocessing's own exit step, run now: it removes its pymp-* directory, inside
            # `made`, which it would otherwise fail to find at exit (a traceback); it runs once.
            sys.modules["multiprocessing.util"]._exit_function()
        shutil.rmtree(made, ignore_errors=True)


@dataclass
class ScriptRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run_script(*argv: str, timeout: float = 120) -> ScriptRun:
    """Run ``python <argv...>`` from the repository root, as `make run-chapterNN` would.

    ``timeout`` is the bound on an idle machine; on a busy one it grows with the load (see
    ``load_scaled``), and a run that still overruns fails with the bound and the load, not a
    bare TimeoutExpired.
    """
    bound, load = load_scaled(timeout)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True,
                              timeout=bound)
    except subprocess.TimeoutExpired:
        pytest.fail(f"python {' '.join(argv)} timed out after {bound:.0f} s; load average was "
                    f"{load:.1f} on {os.cpu_count()} cores when it started ({timeout:.0f} s on "
                    "an idle machine, scaled by the load)", pytrace=False)
    return ScriptRun(proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start)


def refuse_in_process(script: str, *argv: str) -> tuple[int, str]:
    """A chapter script's ``main``, through ``run_main`` as its last line runs it, in this
    process: (exit code, stderr), for input it must refuse before any rank starts.  An
    argparse error ends it as it would end the script: ``SystemExit``'s code.

    A new process would import torch again (about 2.5 CPU-seconds) to print one line; the
    script's own exit path is tested by its runs.  A rank started here fails the test: the
    refusal came too late.  The signal handlers and warning hook ``run_main`` installs are put
    back."""
    import importlib
    import signal
    import warnings
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO
    from unittest import mock

    import torch.multiprocessing

    import ddplab

    module = importlib.import_module(Path(script).stem)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    err = StringIO()

    def no_rank(*_args, **_kwargs):
        raise AssertionError(f"{script} {' '.join(argv)} started ranks instead of refusing")

    try:
        with (mock.patch.object(torch.multiprocessing, "start_processes", no_rank),
              mock.patch.object(subprocess, "Popen", no_rank), warnings.catch_warnings(),
              redirect_stdout(StringIO()), redirect_stderr(err)):
            code = ddplab.run_main(module.main, list(argv))
    except SystemExit as exit_:  # argparse's own refusal, as the interpreter would end it
        code = exit_.code
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return code, err.getvalue()


def load_scaled(seconds: float) -> tuple[float, float]:
    """``seconds`` stretched by how busy the machine is now: (bound, 1-minute load average).

    A run gets its share of the cores: with the load (plus this run) above the core count,
    every process runs that many times slower.  Measured once, at the start of the run.
    """
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this system
        return seconds, 0.0
    share = (load + 1) / (os.cpu_count() or 1)
    return seconds * max(1.0, share), load


def assert_png(path: Path) -> None:
    assert path.is_file(), f"{path} was not written"
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), f"{path} is not a PNG"
    assert len(data) > 5_000, f"{path} is suspiciously small ({len(data)} bytes)"


def load_results(out: Path, chapter: int) -> dict:
    results = json.loads((out / f"chapter{chapter:02d}" / "results.json").read_text())
    assert results["chapter"] == chapter
    return results


def run_quick(tmp_path_factory, script: str, chapter: int, *extra: str) -> tuple:
    """A chapter's ``--quick`` run into a fresh directory: (run, that directory, results.json)."""
    out = tmp_path_factory.mktemp(f"ch{chapter:02d}")
    run = run_script(script, "--quick", *extra, "--out", str(out), timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, out, load_results(out, chapter)


# `make test` runs the tests on two pytest-xdist workers, a group of files at a time.  A file is
# a group of its own, so that its module fixtures (a chapter's --quick run) run once; files
# that share something the machine has once share a group: the network namespaces and veth
# links of chapter 10 (a run removes what an earlier, killed run left), one site build.
SHARED_GROUPS = {"test_chapter10.py": "nodes", "test_faults_nodes.py": "nodes",
                 "test_site.py": "site", "test_browser.py": "site"}
FIRST_GROUP = "nodes"  # the longest, mostly waiting on emulated links: it starts first


def group_of(path: str) -> str:
    name = path.split("::", 1)[0].rsplit("/", 1)[-1]
    return SHARED_GROUPS.get(name, name)


def pytest_collection_modifyitems(items) -> None:
    items.sort(key=lambda item: group_of(item.nodeid) != FIRST_GROUP)  # stable: else as found


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest without xdist: one process, nothing to schedule
    pass
else:
    class _ByGroup(LoadScopeScheduling):
        """xdist's file-by-file scheduling, with the shared groups above kept together (its
        own xdist_group marks need a pytest that still reads ``Item._nodeid``)."""

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    def pytest_xdist_make_scheduler(config, log):
        return _ByGroup(config, log)


PROVENANCE_KEYS = {"torch", "backend", "device", "world_size", "quick", "date", "git_commit"}


# What the tests' own forked ranks import besides what a grading preloads: the fork server
# imports it all once per session, and each rank forked from it starts without importing torch
# or torch._dynamo again (about 2 CPU-seconds a rank).
TEST_WORKER_MODULES = ["ddplab", "bubble_workers", "collective_workers", "ddp_workers",
                       "fsdp_workers", "ring_halves_workers", "ring_workers", "zero_workers"]


def start_fork_server() -> None:
    """Start this process's fork server, if it is not running yet, with what a grading of each
    chapter preloads (``exercises.grader.core.fork_server_preload``) and the tests' workers.

    A learner's grading preloads one chapter; a test process grades every chapter and forks
    ranks of its own, so it starts the server first, with all of them.  The server ends with
    this process (multiprocessing closes its pipe)."""
    import multiprocessing
    from multiprocessing import forkserver

    if str(REPO) not in sys.path:  # `exercises` is a top-level package, as `python -m` sees it
        sys.path.insert(0, str(REPO))
    from exercises.grader.core import fork_server_preload

    grading = [m for c in chapters.with_exercises() for m in fork_server_preload(c.number)]
    multiprocessing.set_forkserver_preload(list(dict.fromkeys(grading + TEST_WORKER_MODULES)))
    forkserver.ensure_running()


def launch_forked(worker, args):
    """``ddplab.launch`` with ranks forked from a fork server that has imported torch.

    Only for tests that check what the ranks compute (sums, bits, errors a rank raises).  Tests
    of how ranks start, stop, die or clean up, and every chapter script, keep the readers'
    ``spawn``."""
    import ddplab

    start_fork_server()
    return ddplab.launch(worker, args, start_method="forkserver")


@pytest.fixture(scope="module")
def fork_server() -> None:
    """For tests that grade in this process: the grader's ranks fork from the suite's server."""
    start_fork_server()


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    return tmp_path / "out"


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> Path:
    """The site as `make docs` builds it (--strict), once per session: tests only read it.

    Built without the reader's OFFLINE and SITE_URL, which would change what is built."""
    site_dir = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # see Makefile
    for name in ("OFFLINE", "SITE_URL"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site_dir)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=load_scaled(300)[0])
    assert proc.returncode == 0, proc.stderr
    return site_dir


@pytest.fixture
def one_rank(tmp_path):
    """A default process group of one gloo rank, in this process, for the duration of a test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()

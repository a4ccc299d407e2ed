"""`make doctor`: will this machine get through the workshop day?  (under 30 s)

Checks, in parallel: Python and torch versions, the packages the book needs, a writable
temporary directory, a 2-rank gloo all-reduce over loopback, a free rendezvous port, usable
cores, GPUs and whether NCCL works on them, free disk space, whether the site builds (mkdocs
build --strict into a temp folder), and what a killed chapter 10 run left (removed, as root).
Prints a ✓ / ! / ✗ table with the fix for each problem; exits 1 when something would block the
day (a ✗), 0 otherwise (a ! is worth knowing but blocks nothing).

An all-reduce that does not answer in time is told apart from a network fault by where its
ranks got to: still importing torch, or connected but slow, is a busy machine ("busy — rerun");
a rendezvous that never connected on an idle machine, or an error, is the network.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 28.0  # the whole check, as promised (< 30 s), torch's import included
STORE_TIMEOUT_S = 8.0  # how long a rank tries to reach the rendezvous before it gives up
BUSY_LOAD_PER_CORE = 1.0  # a 1-minute load average above this per core: the CPUs are taken
PACKAGES = {"torch": "torch", "matplotlib": "matplotlib", "numpy": "numpy", "mkdocs": "mkdocs",
            "material": "mkdocs-material", "pytest": "pytest"}
SETUP_FIX = "run `make setup` (offline: `pip install --no-index --find-links wheelhouse " \
            "-r requirements.txt`, see the workshop guide)"
OK, WARN, FAIL = "✓", "!", "✗"


@dataclass
class Check:
    name: str
    mark: str
    detail: str
    fix: str = ""


def check_python() -> Check:
    version = sys.version.split()[0]
    if sys.version_info < (3, 10):  # noqa: UP036 - doctor runs on any python3, even an old one
        return Check("Python", FAIL, version, "install Python 3.10 or newer")
    return Check("Python", OK, f"{version} ({sys.executable})")


def check_packages() -> Check:
    missing = [pip for module, pip in PACKAGES.items() if importlib.util.find_spec(module) is None]
    if missing:
        return Check("packages", FAIL, "missing: " + ", ".join(missing), SETUP_FIX)
    import torch
    return Check("packages", OK, f"torch {torch.__version__}, and the rest of requirements.txt")


# Each rank prints how far it got, so that a run that does not answer says where it stopped.
PHASES = ("started", "imported", "connected", "joined", "done")
ALL_REDUCE = """
import sys, time
print("started", flush=True)
import torch, torch.distributed as dist
from datetime import timedelta
print("imported", flush=True)
rank, world, port, backend = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
hosts_store, store_timeout, delay = sys.argv[5] == "1", float(sys.argv[6]), float(sys.argv[7])
device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
if backend == "nccl":
    torch.cuda.set_device(device)
store = dist.TCPStore("127.0.0.1", port, world, is_master=hosts_store and rank == 0,
                      timeout=timedelta(seconds=store_timeout))
print("connected", flush=True)
dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                        timeout=timedelta(seconds=60))
print("joined", flush=True)
time.sleep(delay)  # tests: a collective made slow on purpose
t = torch.full((4,), float(rank + 1), device=device)
dist.all_reduce(t)
assert t.tolist() == [world * (world + 1) / 2] * 4, f"wrong sum {t.tolist()}"
dist.destroy_process_group()
print("done", flush=True)
"""


@dataclass
class AllReduceRun:
    ok: bool
    detail: str
    busy: bool = False  # it did not answer in time because the machine is busy


def machine_load() -> tuple[float, int]:
    """The 1-minute load average and the usable cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return load, cores or 1


def _phase(output: str) -> str:
    """The furthest phase a rank printed (before it printed anything: 'not started')."""
    reached = [line for line in output.split() if line in PHASES]
    return reached[-1] if reached else "not started"


def no_answer_verdict(phases: list[str], timeout: float) -> AllReduceRun:
    """Busy or network, from where each rank was when time ran out, and the machine's load."""
    load, cores = machine_load()
    where = ", ".join(f"rank {r}: {p}" for r, p in enumerate(phases))
    loaded = f"load {load:.1f} on {cores} cores"
    if any(p in ("not started", "started") for p in phases):
        return AllReduceRun(False, f"no answer within {timeout:.0f} s: still importing torch "
                            f"({where}; {loaded})", busy=True)
    if all(p == "joined" for p in phases):
        return AllReduceRun(False, f"no answer within {timeout:.0f} s: the ranks connected but "
                            f"the all-reduce was slow ({loaded})", busy=True)
    busy = load / cores > BUSY_LOAD_PER_CORE
    return AllReduceRun(False, f"no answer within {timeout:.0f} s: the ranks never connected "
                        f"({where}; {loaded})", busy=busy)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_reduce_works(world: int, backend: str, timeout: float = 20, *,
                     unreachable: bool = False, delay_s: float = 0.0) -> AllReduceRun:
    """Start ``world`` ranks as plain processes (one torch import each, in parallel).

    Test seams: ``unreachable`` (no rank hosts the rendezvous: a connection that never forms)
    and ``delay_s`` (each rank waits this long before its all-reduce: a slow collective)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "doctor_all_reduce.py"
        script.write_text(ALL_REDUCE)
        port, deadline = free_port(), time.monotonic() + timeout
        store_timeout = min(STORE_TIMEOUT_S, timeout / 2)
        procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port),
                                   backend, str(int(not unreachable)), str(store_timeout),
                                   str(delay_s)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, cwd=tmp)
                 for r in range(world)]
        timed_out = False
        try:
            for p in procs:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            for p in procs:  # never leave a rank behind
                if p.poll() is None:
                    p.kill()
            outputs = [p.communicate()[0] for p in procs]
    failed = [(p, out) for p, out in zip(procs, outputs, strict=True)
              if p.returncode and not (timed_out and p.returncode == -9)]
    if failed:  # an error, not a wait: the ranks could not reach each other
        p, out = failed[0]
        lines = out.strip().splitlines()
        return AllReduceRun(False, lines[-1] if lines else f"exit code {p.returncode}")
    if timed_out:
        return no_answer_verdict([_phase(out) for out in outputs], timeout)
    return AllReduceRun(True, "ok")


def check_gloo(timeout: float = 20, **seams) -> Check:
    run = all_reduce_works(2, "gloo", timeout, **seams)
    if run.ok:
        return Check("gloo all-reduce", OK, "2 ranks over loopback (127.0.0.1)")
    if run.busy:
        return Check("gloo all-reduce", WARN, f"busy — rerun: {run.detail[:160]}",
                     "the CPUs are taken by other programs: close them (or wait) and rerun "
                     "`make doctor`; nothing points at the network")
    return Check("gloo all-reduce", FAIL, run.detail[:160],
                 "check that 127.0.0.1 works and no firewall blocks local TCP; on a VPN, "
                 "try GLOO_SOCKET_IFNAME=lo (Linux) or lo0 (macOS)")


def check_port(port: int) -> Check:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return Check("port", WARN, f"{port} is taken (torchrun's default MASTER_PORT)",
                         f"use `torchrun --master-port <another>`; or find the owner: "
                         f"`lsof -i :{port}` (the chapter scripts pick a free port themselves)")
    return Check("port", OK, f"{port} is free (torchrun's default MASTER_PORT)")


def check_cores() -> Check:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if (cores or 1) < 2:
        return Check("cores", WARN, f"{cores} usable", "ranks will share one core: use --quick, "
                     "expect slower runs and noisier timings")
    return Check("cores", OK, f"{cores} usable")


def check_gpus(timeout: float = 20) -> Check:
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return Check("GPUs", OK, "none (every chapter runs on CPU with gloo)")
    if not torch.distributed.is_nccl_available():
        return Check("GPUs", WARN, f"{count}, but this torch has no NCCL", "use --backend gloo")
    world = min(count, 2)
    run = all_reduce_works(world, "nccl", timeout)
    ok, last = run.ok, run.detail
    if ok:
        return Check("GPUs", OK, f"{count} ({torch.cuda.get_device_name(0)}), nccl all-reduce "
                     f"on {world} works")
    return Check("GPUs", WARN, f"{count}, but nccl failed: {last[:100]}",
                 "run the chapters with --backend gloo; check the driver with nvidia-smi")


def check_disk(path: Path = REPO, need_gb: float = 2.0) -> Check:
    free = shutil.disk_usage(path).free / 2**30
    if free < need_gb:
        return Check("disk", FAIL, f"{free:.1f} GiB free", f"free at least {need_gb:.0f} GiB")
    return Check("disk", OK, f"{free:.0f} GiB free")


def check_tmp() -> Check:
    """A temporary directory we can write: the checks and every chapter run need one."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "probe").write_bytes(b"ok")
            where = str(Path(tmp).parent)
    except OSError as err:  # none usable (tempfile tries $TMPDIR, /tmp, /var/tmp, ...)
        return Check("temp dir", FAIL, f"none writable: {err}",
                     "set TMPDIR to a writable directory with free space, e.g. "
                     "`mkdir -p ~/tmp && export TMPDIR=~/tmp`")
    return Check("temp dir", OK, f"{where} is writable")


def _load_netns():
    """ddplab/run/netns.py on its own (standard library only): importing the ddplab package
    would import all of torch's distributed machinery for one listing."""
    spec = importlib.util.spec_from_file_location("doctor_netns",
                                                  REPO / "scripts/ddplab/run/netns.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def check_leftovers() -> Check:
    """What a chapter 10 run killed before it could clean up left: removed, as root."""
    netns = _load_netns()
    if shutil.which("ip") is None:
        return Check("leftovers", OK, "none (no network namespaces here)")
    if netns.unavailable_reason() is not None:
        return Check("leftovers", OK, "not checked (removing them needs root)")
    try:
        scratch_root = tempfile.gettempdir()
    except OSError:
        scratch_root = None
    removed = netns.remove_leftovers(scratch_root)
    if removed:
        return Check("leftovers", WARN, netns.leftovers_line(removed))
    return Check("leftovers", OK, "none from a killed chapter 10 run")


def check_site(timeout: float = 60) -> Check:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        return Check("site", FAIL, "mkdocs is not installed", SETUP_FIX)
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        try:
            proc = subprocess.run([str(mkdocs), "build", "--strict", "-q", "-d", out], cwd=REPO,
                                  capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return Check("site", WARN, f"the build took over {timeout:.0f} s",
                         "`make docs` to see why (on a busy machine: rerun)")
    if proc.returncode:
        last = [line for line in proc.stderr.splitlines() if line.strip()][-1:]
        return Check("site", FAIL, (last or ["failed"])[0][:120],
                     "`make docs` shows the whole error; `make serve` to read the book locally")
    return Check("site", OK, "builds (mkdocs build --strict)")


def run_checks(port: int, site: bool, deadline: float) -> list[Check]:
    basics = [check_python(), check_packages()]
    if basics[1].mark == FAIL:  # without torch nothing else can run
        return basics
    left = max(5.0, deadline - time.monotonic())  # what is left of the budget, for the slow ones
    jobs = {"temp dir": check_tmp, "gloo all-reduce": lambda: check_gloo(left),
            "port": lambda: check_port(port), "cores": check_cores,
            "GPUs": lambda: check_gpus(left), "disk": check_disk, "leftovers": check_leftovers}
    if site:
        jobs["site"] = lambda: check_site(left)
    with ThreadPoolExecutor(len(jobs)) as pool:
        return basics + list(pool.map(lambda item: _as_row(*item), jobs.items()))


def _as_row(name: str, check) -> Check:
    """A check that failed in an unforeseen way is a ✗ row with its reason, not a traceback."""
    try:
        return check()
    except Exception as err:
        return Check(name, FAIL, f"could not check: {type(err).__name__}: {err}"[:160])


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1 to 65535)")
    return port


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    deadline = time.monotonic() + BUDGET_S
    parser = OneLineParser(prog="doctor.py", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=port_number, default=29500, help="the port to check")
    parser.add_argument("--no-site", action="store_true", help="skip the site build")
    args = parser.parse_args(argv)
    checks = run_checks(args.port, site=not args.no_site, deadline=deadline)
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f" {c.mark} {c.name:<{width}}  {c.detail}")
        if c.fix:
            print(f"   {'':<{width}}  fix: {c.fix}")
    blocking = [c.name for c in checks if c.mark == FAIL]
    if blocking:
        print(f"error: {', '.join(blocking)} would block the workshop day: see the fixes above")
        return 1
    print("Ready for the workshop.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

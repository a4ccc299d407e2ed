"""`make doctor`: will this machine get through the workshop day?  (under 30 s)

Checks, in parallel: Python and torch versions, the packages the book needs, a 2-rank gloo
all-reduce over loopback, a free rendezvous port, usable cores, GPUs and whether NCCL works on
them, free disk space, and whether the site builds (mkdocs build --strict into a temp folder).
Prints a ✓ / ! / ✗ table with the fix for each problem; exits 1 when something would block the
day (a ✗), 0 otherwise (a ! is worth knowing but blocks nothing).
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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


ALL_REDUCE = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
rank, world, port, backend = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
if backend == "nccl":
    torch.cuda.set_device(device)
dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=timedelta(seconds=20))
t = torch.full((4,), float(rank + 1), device=device)
dist.all_reduce(t)
assert t.tolist() == [world * (world + 1) / 2] * 4, f"wrong sum {t.tolist()}"
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_reduce_works(world: int, backend: str, timeout: float = 25) -> tuple[bool, str]:
    """Start ``world`` ranks as plain processes (one torch import each, in parallel)."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "doctor_all_reduce.py"
        script.write_text(ALL_REDUCE)
        port = free_port()
        procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port),
                                   backend], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, cwd=tmp) for r in range(world)]
        try:
            outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        except subprocess.TimeoutExpired:
            return False, f"no answer within {timeout:.0f} s"
        finally:
            for p in procs:  # never leave a rank behind
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for p, out in zip(procs, outputs, strict=True):
        if p.returncode:
            lines = out.strip().splitlines()
            return False, lines[-1] if lines else f"exit code {p.returncode}"
    return True, "ok"


def check_gloo() -> Check:
    ok, last = all_reduce_works(2, "gloo")
    if ok:
        return Check("gloo all-reduce", OK, "2 ranks over loopback (127.0.0.1)")
    return Check("gloo all-reduce", FAIL, last[:120],
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


def check_gpus() -> Check:
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return Check("GPUs", OK, "none (every chapter runs on CPU with gloo)")
    if not torch.distributed.is_nccl_available():
        return Check("GPUs", WARN, f"{count}, but this torch has no NCCL", "use --backend gloo")
    world = min(count, 2)
    ok, last = all_reduce_works(world, "nccl")
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


def check_site() -> Check:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        return Check("site", FAIL, "mkdocs is not installed", SETUP_FIX)
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        try:
            proc = subprocess.run([str(mkdocs), "build", "--strict", "-q", "-d", out], cwd=REPO,
                                  capture_output=True, text=True, timeout=60, env=env)
        except subprocess.TimeoutExpired:
            return Check("site", WARN, "the build took over 60 s", "`make docs` to see why")
    if proc.returncode:
        last = [line for line in proc.stderr.splitlines() if line.strip()][-1:]
        return Check("site", FAIL, (last or ["failed"])[0][:120],
                     "`make docs` shows the whole error; `make serve` to read the book locally")
    return Check("site", OK, "builds (mkdocs build --strict)")


def run_checks(port: int, site: bool) -> list[Check]:
    basics = [check_python(), check_packages()]
    if basics[1].mark == FAIL:  # without torch nothing else can run
        return basics
    jobs = [check_gloo, lambda: check_port(port), check_cores, check_gpus, check_disk]
    if site:
        jobs.append(check_site)
    with ThreadPoolExecutor(len(jobs)) as pool:
        return basics + list(pool.map(lambda job: job(), jobs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=29500, help="the port to check")
    parser.add_argument("--no-site", action="store_true", help="skip the site build")
    args = parser.parse_args(argv)
    checks = run_checks(args.port, site=not args.no_site)
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

"""What a reader's laptop sees: the right torch build is chosen, and a reader's runs leave the
checkout as it was (`git status` clean), so a `git pull` of the book never conflicts with them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def setup_commands(tmp_path: Path, path_dirs: list[Path], *make_vars: str) -> str:
    """The commands `make setup` would run for a fresh .venv (-n: print, run nothing)."""
    # Not the variables of a make that runs this test (CI's `make test ... TORCH_INDEX=` would
    # reach the inner make through MAKEFLAGS and decide for it).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL",
                                                           "TORCH_INDEX", "CONSTRAINTS")}
    env["PATH"] = os.pathsep.join([*map(str, path_dirs), "/usr/bin", "/bin"])
    venv = tmp_path / "venv"
    proc = subprocess.run(["make", "-n", "-B", f"{venv}/.installed", f"VENV={venv}", *make_vars],
                          cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return proc.stdout


def pip_line(commands: str) -> str:
    return next(line for line in commands.splitlines() if "pip install" in line)


@pytest.fixture
def fake_nvidia_smi(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-smi"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    return bin_dir


@pytest.mark.skipif(sys.platform != "linux", reason="the CUDA-by-default wheel is Linux's")
def test_a_linux_machine_without_an_nvidia_driver_gets_the_cpu_build(tmp_path):
    commands = setup_commands(tmp_path, [])
    assert f"--extra-index-url {CPU_INDEX}" in pip_line(commands)
    assert "no NVIDIA driver found" in commands  # and says why


def test_a_gpu_box_gets_pypis_torch(tmp_path, fake_nvidia_smi):
    assert "--extra-index-url" not in pip_line(setup_commands(tmp_path, [fake_nvidia_smi]))


@pytest.mark.skipif(sys.platform != "linux", reason="the CUDA-by-default wheel is Linux's")
def test_the_cpu_pin_still_comes_from_the_cpu_index_and_an_explicit_choice_wins(tmp_path):
    pinned = pip_line(setup_commands(tmp_path, [], "CONSTRAINTS=constraints/cpu.txt"))
    assert "-c constraints/cpu.txt" in pinned and f"--extra-index-url {CPU_INDEX}" in pinned
    ci = pip_line(setup_commands(tmp_path, [], "CONSTRAINTS=constraints/cpu.txt", "TORCH_INDEX="))
    assert "--extra-index-url" not in ci


def git(cwd: Path, *argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.slow
def test_a_readers_runs_leave_git_status_clean(tmp_path):
    """A fresh clone; then what a reader does first: a chapter, grading, the hello script."""
    clone = tmp_path / "book"
    git(tmp_path, "clone", "--quiet", str(REPO), str(clone))
    for path in git(REPO, "status", "--porcelain", "--untracked-files=no").splitlines():
        # Uncommitted work in the checkout under test is what the clone must run too.
        name = path[3:]
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, clone / name)
    git(clone, "add", "-A")
    git(clone, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet",
        "--allow-empty", "-m", "the tree under test")
    (clone / ".venv").symlink_to(Path(sys.executable).parents[1])  # the set-up is not under test
    keep_venv = ["-o", ".venv/.installed"]  # the clone is newer than the stamp: do not rebuild
    readers_runs = [
        ["make", *keep_venv, "run-chapter01", "ARGS=--quick"],
        ["make", *keep_venv, "grade-05"],
        [sys.executable, "scripts/hello_ddp.py"],
    ]
    for argv in readers_runs:
        proc = subprocess.run(argv, cwd=clone, capture_output=True, text=True, timeout=600)
        # Grading the untouched stubs fails (make says 2) after grading every exercise.
        graded = "grade" in argv[-1] and "not implemented yet" in proc.stdout
        assert proc.returncode == 0 or graded, f"{argv}: {proc.stdout[-1500:]}{proc.stderr[-1500:]}"
        status = git(clone, "status", "--porcelain")
        assert status == "", f"after {' '.join(argv)}, git status shows:\n{status}"
    assert (clone / "out" / "chapter01" / "results.json").is_file()  # the run did write

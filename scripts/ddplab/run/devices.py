"""Where each rank computes: ``--device`` and ``--backend`` turned into one placement, before any
process starts, so that an impossible combination is one clear line instead of a crash in a rank.

=============  =========  ======  ==============  ==============================================
GPUs here      --device   ranks   --backend auto  what runs
=============  =========  ======  ==============  ==============================================
0              auto/cpu   N       gloo            N CPU processes (a laptop)
≥ N            auto/cuda  N       nccl            one GPU per rank: the production set-up
1              auto/cuda  N > 1   gloo            every rank on cuda:0, CUDA tensors through gloo
1              auto/cuda  1       nccl            the nccl code path with a single rank
=============  =========  ======  ==============  ==============================================

NCCL refuses two ranks on one GPU (each communicator needs a device of its own), so a 1-GPU box
shares its GPU over gloo, which reduces CUDA tensors by staging them through host memory.  gloo
has no point-to-point for CUDA tensors: chapters 02-03 stage those through the CPU themselves.
``--backend gloo`` with ``--device auto`` keeps the ranks on the CPU, as it always did.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .cli import DEVICES, UsageError


def gpu_count() -> int:
    """CUDA GPUs this process can see (0 on a CPU build of torch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_world_size() -> int:
    """One rank per GPU when there are at least two GPUs, else two processes."""
    gpus = gpu_count()
    return gpus if gpus >= 2 else 2


def usable_cores() -> int:
    """The cores this process may run on: a container or a job scheduler (Slurm, taskset) may
    pin it to fewer than ``os.cpu_count()``.  (A CPU *quota* — docker --cpus, Kubernetes
    limits — is not visible here: the process still sees every core it may be scheduled on.)"""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Placement:
    """The backend every rank joins with and the device each rank computes on."""

    backend: str  # "gloo" or "nccl"
    device_type: str  # "cpu" or "cuda"
    gpus: int  # CUDA GPUs visible on this machine

    def device_for(self, local_rank: int) -> torch.device:
        """Rank ``local_rank``'s device: its own GPU, or GPU 0 shared when there are fewer GPUs."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", local_rank % self.gpus)

    def shares_gpu(self, ranks_on_this_machine: int) -> bool:
        return self.device_type == "cuda" and ranks_on_this_machine > self.gpus


# --8<-- [start:place]
def place(device: str, backend: str, ranks_on_this_machine: int, *, gpus: int | None = None,
          nccl_available: bool | None = None) -> Placement:
    """Check ``--device``/``--backend`` against this machine; raise UsageError if they can't work.

    ``gpus`` and ``nccl_available`` default to what this machine has (tests pass their own).
    """
    gpus = gpu_count() if gpus is None else gpus
    nccl = dist.is_nccl_available() if nccl_available is None else nccl_available
    if device not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        device = "cuda" if gpus > 0 and backend != "gloo" else "cpu"
    if device == "cuda" and gpus == 0:
        raise UsageError("--device cuda: no CUDA GPU is visible (a CPU build of torch, no driver, "
                         "or CUDA_VISIBLE_DEVICES is empty); use --device cpu")
    if backend == "nccl":
        _check_nccl(device, ranks_on_this_machine, gpus, nccl)
    if backend == "auto":
        one_gpu_each = device == "cuda" and nccl and gpus >= ranks_on_this_machine
        backend = "nccl" if one_gpu_each else "gloo"
    return Placement(backend=backend, device_type=device, gpus=gpus)
# --8<-- [end:place]


def _check_nccl(device: str, ranks: int, gpus: int, nccl: bool) -> None:
    if device == "cpu":
        raise UsageError("--backend nccl moves CUDA tensors only; with --device cpu use "
                         "--backend gloo")
    if not nccl:
        raise UsageError("--backend nccl: this torch build has no NCCL (a CPU build?); "
                         "use --backend gloo")
    if gpus < ranks:
        # NCCL cannot put two ranks on one GPU: say so before NCCL does, cryptically.
        hint = f"--world-size {gpus} or " if gpus > 1 else "--world-size 1 or "
        raise UsageError(f"--backend nccl needs one GPU per rank: {ranks} ranks on this machine "
                         f"but {gpus} GPU(s) found; use {hint}--backend gloo")

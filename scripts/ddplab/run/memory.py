"""Peak memory of one piece of work, on a GPU or on the CPU.

On a GPU we ask PyTorch's caching allocator: ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``.  It counts the tensors PyTorch allocates (parameters, gradients,
DDP's buckets, activations), not memory outside the allocator: the CUDA context, NCCL's own
communication buffers, cuBLAS workspaces.  ``nvidia-smi`` shows more than this for that reason.
On the CPU there is no such counter, so we ask the operating system for the process's resident
set size (RSS): Linux keeps its high-water mark (``VmHWM`` in /proc/self/status) and lets a
process reset it (write ``5`` to /proc/self/clear_refs).  Before the reset, freed memory is
handed back to the OS (glibc's ``malloc_trim``), so that the next measurement sees its own
allocations grow the RSS instead of reusing pages freed earlier.

``peak.mib`` is the peak growth above a baseline: the level when the ``with`` block started, or
that of an earlier measurement (``since=``), so that a later phase can be measured against the
same starting point.  It is None where the OS cannot tell (macOS, Windows).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
MiB = 2**20


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _give_freed_memory_back() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def cpu_peak_supported() -> bool:
    return _STATUS.exists() and _CLEAR_REFS.exists()


class PeakMemory:
    """``with PeakMemory(device) as peak: work()`` then ``peak.mib``: MiB the work added at peak.

    ``PeakMemory(device, since=earlier)``: the peak of this block above ``earlier``'s baseline.
    """

    def __init__(self, device: torch.device, since: PeakMemory | None = None):
        self.device = device
        self.since = since
        self.mib: float | None = None
        self._start = 0

    def __enter__(self) -> PeakMemory:
        _give_freed_memory_back()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        elif cpu_peak_supported():
            _CLEAR_REFS.write_text("5")  # VmHWM := VmRSS
            self._start = _status_kib("VmRSS") * 1024
        if self.since is not None:
            self._start = self.since._start
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.mib = (torch.cuda.max_memory_allocated(self.device) - self._start) / MiB
        elif cpu_peak_supported():
            self.mib = (_status_kib("VmHWM") * 1024 - self._start) / MiB

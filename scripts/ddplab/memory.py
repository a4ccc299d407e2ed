"""Peak memory of one piece of work, on a GPU or on the CPU.

On a GPU, PyTorch's caching allocator counts every byte: ``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats``.  On the CPU there is no such counter, so we ask the operating
system for the process's resident set size (RSS): Linux keeps its high-water mark (``VmHWM`` in
/proc/self/status) and lets a process reset it (write ``5`` to /proc/self/clear_refs).  Before
the reset, freed memory is handed back to the OS (glibc's ``malloc_trim``), so that the next
measurement sees its own allocations grow the RSS instead of reusing pages freed earlier.

``peak.mib`` is the growth above the level at the start: what the measured work added.  It is
None where the OS cannot tell (macOS, Windows).
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
    """``with PeakMemory(device) as peak: work()`` then ``peak.mib``: MiB the work added at peak."""

    def __init__(self, device: torch.device):
        self.device = device
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
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.mib = (torch.cuda.max_memory_allocated(self.device) - self._start) / MiB
        elif cpu_peak_supported():
            self.mib = (_status_kib("VmHWM") * 1024 - self._start) / MiB

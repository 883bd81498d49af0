"""Peak-memory measurement for a block of code, on CUDA and on CPU.

Design: on CUDA the caching allocator keeps exact peak statistics, so we reset and read them.
On CPU torch keeps none, so we read the process's resident-set high-water mark: Linux lets a
process reset it (``/proc/self/clear_refs`` with ``5``) and report it (``VmHWM``), and
``malloc_trim`` hands freed heap back first so an earlier run's garbage does not count. The CPU
figure is therefore "resident memory added at the peak", which includes allocator slack; it is
meant for comparing modes measured the same way, side by side.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys

import torch

__all__ = ["PeakMemory"]


def _read_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _trim() -> None:
    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # a libc without malloc_trim: nothing to hand back
            ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak_bytes`` (None where unmeasurable).

    ``m.peak_bytes`` is the memory added at the peak of the block relative to its start.
    """

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.peak_bytes: int | None = None
        self._start = 0

    def __enter__(self) -> PeakMemory:
        _trim()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
            self._start = _read_status("VmRSS") or 0
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        else:
            peak = _read_status("VmHWM")
            self.peak_bytes = None if peak is None else max(0, peak - self._start)

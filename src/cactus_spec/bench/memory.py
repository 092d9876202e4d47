"""Peak memory of one generation.

On CUDA: the peak of allocated device memory (``torch.cuda.max_memory_allocated``),
reset before each generation. On CPU (Linux): the process's peak resident set size
(VmHWM), reset by writing 5 to /proc/self/clear_refs; it includes the loaded models, so
it is the footprint of the whole process while that generation ran. Where the reset is
not possible, the peak since the process started (ru_maxrss).
"""

from __future__ import annotations

import contextlib
import re
import resource
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak(device: torch.device) -> None:
    """Start measuring the peak afresh."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):  # not Linux, or not allowed: the lifetime peak
        _CLEAR_REFS.write_text("5")


def peak_bytes(device: torch.device) -> int:
    """The peak since the last ``reset_peak``, in bytes."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        found = re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text())
    except OSError:
        found = None
    if found:
        return int(found.group(1)) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux

"""Peak memory of a span of this process, for the benchmark's memory columns.

On CUDA the allocator keeps the figure: ``torch.cuda.reset_peak_memory_stats`` before the span and
``max_memory_allocated`` after, less what was allocated before. On a CPU the kernel keeps it: writing ``5``
to ``/proc/self/clear_refs`` resets the process's high-water mark of resident memory (``VmHWM`` in
``/proc/self/status``, Linux 4.0 on) to what is resident now (``VmRSS``); after the span ``VmHWM`` less that
``VmRSS`` is the span's peak. Freed heap the C library still holds is handed back first (glibc's
``malloc_trim``), so a span is not flattered by memory an earlier one left resident. Where none of that is
available (no ``/proc``, another device) the figure is ``None``, printed ``n/a``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from pathlib import Path

import torch

__all__ = ["Peak", "peak_memory", "text"]

PROC = Path("/proc/self")


class Peak:
    """What :func:`peak_memory` found: ``bytes`` the span's peak above where it started (None: unknown), and
    ``how`` it was measured."""

    __slots__ = ("bytes", "how")

    def __init__(self, how: str) -> None:
        self.bytes: int | None = None
        self.how = how


def _kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes, or None where it cannot be read."""
    try:
        for line in (PROC / "status").read_text().splitlines():
            if line.startswith(field + ":"):
                return 1024 * int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _release_free_heap() -> None:
    """Hand the C library's free heap back to the kernel (glibc's ``malloc_trim(0)``; elsewhere nothing)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def _reset_high_water_mark() -> bool:
    """Reset ``VmHWM`` to the current ``VmRSS``; False where the kernel does not let us."""
    try:
        (PROC / "clear_refs").write_text("5")
    except OSError:
        return False
    return _kib("VmHWM") is not None and _kib("VmRSS") is not None


@contextlib.contextmanager
def peak_memory(device: torch.device | str = "cpu"):
    """Measure the peak memory of the ``with`` body on ``device``: yields a :class:`Peak` whose ``bytes`` is set
    when the body ends (None where this process cannot tell)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        peak = Peak("torch.cuda.max_memory_allocated")
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        yield peak
        torch.cuda.synchronize(device)
        peak.bytes = torch.cuda.max_memory_allocated(device) - before
        return
    if device.type != "cpu":
        yield Peak(f"not measured on {device.type}")
        return
    _release_free_heap()
    if not _reset_high_water_mark():
        yield Peak("not measured: /proc/self/clear_refs and VmHWM are not available")
        return
    peak = Peak("VmHWM of /proc/self/status")
    before = _kib("VmRSS")
    yield peak
    high = _kib("VmHWM")
    if before is not None and high is not None:
        peak.bytes = max(0, high - before)


def text(nbytes: int | None) -> str:
    """``nbytes`` as MiB for a table, ``n/a`` where unknown."""
    return "n/a" if nbytes is None else f"{nbytes / 2 ** 20:.1f} MiB"

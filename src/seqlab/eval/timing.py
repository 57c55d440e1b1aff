"""Timing and memory probes: wall clocks that respect asynchronous devices, and per-request peak memory.

Both are easy to get subtly wrong: a CUDA clock read without a synchronize measures the launch, not the work, and
``ru_maxrss`` is a process-lifetime high-water mark, so on CPU the kernel's peak-RSS counter is reset
(``/proc/self/clear_refs``) at the start of a measurement when the kernel allows it.
"""
from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator

import torch

from seqlab.runtime.memory import status_kib


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued device work so that a clock read afterwards includes it (no-op on CPU)."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(dev)
    elif dev is not None and dev.type == "mps" and hasattr(torch, "mps"):
        torch.mps.synchronize()


def now(device: torch.device | str | None = None) -> float:
    """``time.perf_counter()`` after a device synchronize."""
    synchronize(device)
    return time.perf_counter()


def reset_peak_memory(device: torch.device | str | None = None) -> bool:
    """Start a new peak-memory window. Returns False when only the process-lifetime peak is available."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(dev)
        return True
    try:  # Linux >= 4.0: writing "5" resets VmHWM (peak RSS) to the current RSS for this process
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory_bytes(device: torch.device | str | None = None) -> int:
    """Peak memory since the last ``reset_peak_memory``: ``max_memory_allocated`` on CUDA, peak RSS on CPU."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(dev))
    hwm = status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class Stopwatch:
    """Named laps on one device clock: ``sw.lap("prefill")`` returns seconds since the previous lap."""

    def __init__(self, device: torch.device | str | None = None):
        self.device = device
        self.start = now(device)
        self.last = self.start
        self.laps: dict[str, float] = {}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside the block belongs to no lap: a generator's caller, between two chunks, is not decoding."""
        t = now(self.device)
        try:
            yield
        finally:
            self.last += now(self.device) - t

    def lap(self, name: str) -> float:
        t = now(self.device)
        dt = t - self.last
        self.laps[name] = self.laps.get(name, 0.0) + dt
        self.last = t
        return dt

    @property
    def total(self) -> float:
        return self.last - self.start

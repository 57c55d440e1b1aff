"""Helpers the bench scripts share: a count-list option checked at the start, and the process's memory readings."""
from __future__ import annotations

from pathlib import Path


def status_mib(field: str) -> float:
    """A ``/proc/self/status`` memory field (``VmHWM``: the peak RSS since the window began; ``VmRSS``) in MiB."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def check_count_list(ap, flag: str, value: str) -> list[int]:
    """A comma list of counts (``--batches 1,8``), each >= 1, or the parser's error naming the flag."""
    try:
        counts = [int(v) for v in value.split(",")]
    except ValueError:
        ap.error(f"{flag}: expected comma-separated whole numbers, got {value!r}")
    if any(c < 1 for c in counts):
        ap.error(f"{flag}: every count must be >= 1, got {value!r}")
    return counts

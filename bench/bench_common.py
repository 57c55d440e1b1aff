"""Helpers the bench scripts share: count options checked at the start, and the process's memory readings."""
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


def check_positive(ap, args, names: tuple[str, ...]) -> None:
    """Each of ``names`` (argparse dests) >= 1 where given, or the parser's error naming the flag: said at the start,
    not as a ZeroDivisionError or a median of nothing minutes in."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")

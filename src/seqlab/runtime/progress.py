"""One progress bar for every long loop: live on a terminal, a line every few seconds in a log.

tqdm redraws in place on a TTY; in a log file or CI that becomes thousands of lines, so off a TTY the bar
only prints when ``log_every_s`` has passed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm.auto import tqdm


def progress(iterable: Iterable | None = None, *, total: float | None = None, desc: str = "", unit: str = "it",
             enabled: bool = True, log_every_s: float = 30.0, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr; ``enabled=False`` gives a silent one with the same interface."""
    tty = sys.stderr.isatty()
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr,
                dynamic_ncols=tty, mininterval=0.1 if tty else log_every_s,
                maxinterval=10.0 if tty else log_every_s, **kwargs)

"""Stop a long run politely: the first SIGINT/SIGTERM asks the driver to finish its step and checkpoint.

Killing a run mid-step loses everything since the last checkpoint; finishing the step costs seconds. A second
signal means the user does not want to wait, so it raises ``KeyboardInterrupt`` at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType


class GracefulStop:
    """``with GracefulStop() as stop: ... if stop.requested: checkpoint and leave``.

    Outside the main thread (where Python cannot install handlers) it does nothing and never requests a stop.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM), message: str = ""):
        self.signals = signals
        self.message = message or "finishing this step, writing a checkpoint, then exiting (signal again to quit now)"
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def exit_code(self) -> int:
        """The shell's convention for death by signal: 128 + its number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum if self.signum is not None else 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.requested, self.signum = True, signum
        print(f"\n[seqlab] {signal.Signals(signum).name}: {self.message}", file=sys.stderr, flush=True)

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

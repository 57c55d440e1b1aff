"""What a training run ends with: its result, or one of the two ways it stops early (kept apart from the Trainer,
which raises and returns them, so callers can name them without the training machinery)."""

from __future__ import annotations

from dataclasses import dataclass, field


class TrainingDiverged(RuntimeError):
    """The loss, the gradient norm or the weights became NaN or infinite; the message names the step and the last
    good checkpoint."""


class StopTraining(Exception):
    """Raised by a callback to end ``fit`` early (tests use it to simulate a kill right after a checkpoint)."""


@dataclass
class TrainResult:
    step: int
    loss: float | None
    tokens_seen: int
    train_seconds: float
    eval: dict[str, float] = field(default_factory=dict)
    eval_step: int | None = None  # the step ``eval`` was measured at (a stopped run's may be an earlier one)
    checkpoint: str | None = None
    losses: list[float] = field(default_factory=list)  # per-step losses of this call (all steps, not just logged)
    signal: int | None = None  # the signal that ended the run early (after a checkpoint at its step)

"""Learning-rate schedule: linear warmup, then cosine decay to ``lr * min_lr_ratio``.

The schedule is a pure function of *training progress* ``p`` in [0, 1], so it has no state of its own to
checkpoint: the trainer saves the step (and the training seconds spent) and the lr follows.

Progress is ``step / max_steps``, or, when a wall-clock budget ``max_time_s`` is set,
``max(step / max_steps, train_seconds / max_time_s)``. The time-based form is what a "best model in five
minutes" job wants: on a machine that is slower (or shared with other work) the cosine still reaches its end
exactly when the budget runs out, instead of being cut off mid-decay at a high learning rate. It is not
bit-reproducible across runs, by nature; step-based schedules are (and are what the resume tests use).
"""

from __future__ import annotations

import math

from seqlab.train.config import TrainConfig


class LRSchedule:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    def progress(self, step: int, train_seconds: float = 0.0) -> float:
        """Fraction of training done after ``step`` optimizer steps, in [0, 1]."""
        p = step / self.cfg.max_steps
        if self.cfg.max_time_s is not None:
            p = max(p, train_seconds / self.cfg.max_time_s)
        return min(p, 1.0)

    def warmup_progress(self) -> float:
        if self.cfg.warmup_frac is not None:
            return self.cfg.warmup_frac
        return min(self.cfg.warmup_steps / self.cfg.max_steps, 1.0)

    def __call__(self, step: int, train_seconds: float = 0.0) -> float:
        """Learning rate for optimizer step number ``step`` (0-based: the first update uses step=0)."""
        cfg = self.cfg
        if cfg.warmup_frac is None and step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
        p = self.progress(step, train_seconds)
        pw = self.warmup_progress()
        if cfg.warmup_frac is not None and p < pw:
            return cfg.lr * max(p / pw, 1.0 / (cfg.max_steps + 1))
        if cfg.schedule == "constant":
            return cfg.lr
        decay = 0.0 if pw >= 1.0 else min(max((p - pw) / (1.0 - pw), 0.0), 1.0)
        lo = cfg.lr * cfg.min_lr_ratio
        return lo + 0.5 * (1.0 + math.cos(math.pi * decay)) * (cfg.lr - lo)

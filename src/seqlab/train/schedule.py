"""The Trainer's learning rate: ``runtime.warmup_cosine`` over steps, or the same shape over wall-clock progress.

Progress is ``step / max_steps``, or, with a time budget ``max_time_s``, ``max(step / max_steps, train_seconds /
max_time_s)``: on a slower or busier machine the cosine still ends when the budget does instead of being cut off
at a high learning rate. Time-based runs are not bit-reproducible, by nature; step-based ones are.
"""

from __future__ import annotations

from seqlab.runtime.schedule import cosine_decay, warmup_cosine
from seqlab.train.config import TrainConfig


# Under a time budget a warmup counted in steps may need more steps than the budget holds: it then ends, at the
# latest, when this fraction of the budget is spent, so the run still reaches its peak and decays
TIME_WARMUP_CAP = 0.5


class LRSchedule:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    def progress(self, step: int, train_seconds: float = 0.0) -> float:
        """Fraction of training done after ``step`` optimizer steps, in [0, 1]."""
        p = step / self.cfg.max_steps
        if self.cfg.max_time_s is not None:
            p = max(p, train_seconds / self.cfg.max_time_s)
        return min(p, 1.0)

    def warmup_progress(self, step: int = 0, train_seconds: float = 0.0) -> float:
        """Progress at which warmup ends. Counted in steps, it ends after ``warmup_steps`` of them; under a time
        budget that is also a time, ``train_seconds * warmup_steps / step`` at the steady step time, so that the
        cosine starts from the peak where warmup leaves it (measured in step progress alone it started further
        along: 0.99 of the peak at the last warmup step, 0.63 at the next), and at most ``TIME_WARMUP_CAP``."""
        if self.cfg.warmup_frac is not None:
            return self.cfg.warmup_frac
        pw = min(self.cfg.warmup_steps / self.cfg.max_steps, 1.0)
        if self.cfg.max_time_s is not None:
            if step > 0:
                pw = max(pw, train_seconds * self.cfg.warmup_steps / step / self.cfg.max_time_s)
            return min(pw, TIME_WARMUP_CAP)
        return min(pw, 1.0)

    def __call__(self, step: int, train_seconds: float = 0.0) -> float:
        """Learning rate for optimizer step number ``step`` (0-based: the first update uses step=0)."""
        cfg = self.cfg
        step_based = cfg.warmup_frac is None and cfg.max_time_s is None
        if step_based and cfg.schedule == "cosine":
            return warmup_cosine(step, cfg.max_steps, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio)
        p, pw = self.progress(step, train_seconds), self.warmup_progress(step, train_seconds)
        if cfg.warmup_frac is None and step < cfg.warmup_steps:
            ramp = (step + 1) / (cfg.warmup_steps + 1)
            if cfg.max_time_s is None:
                return cfg.lr * ramp
            if p < pw:  # a budget too short for the steps' warmup ramps up by time too (once a step time is known)
                return cfg.lr * (max(ramp, p / pw) if step > 0 else ramp)
        elif cfg.warmup_frac is not None and p < pw:
            # the ramp of the same warmup in steps (step 0 at lr / (warmup steps + 1)); under a time budget at least
            # the time's share of it
            ramp = (step + 1) / (pw * cfg.max_steps + 1)
            return cfg.lr * (ramp if cfg.max_time_s is None else max(p / pw, ramp))
        if cfg.schedule == "constant":
            return cfg.lr
        return cosine_decay(0.0 if pw >= 1.0 else max(p - pw, 0.0) / (1.0 - pw), cfg.lr, cfg.min_lr_ratio)

    def apply(self, optimizer, step: int, train_seconds: float = 0.0) -> float:
        """Set every parameter group's learning rate for update ``step``; return it."""
        lr = self(step, train_seconds)
        for g in optimizer.param_groups:
            g["lr"] = lr
        return lr

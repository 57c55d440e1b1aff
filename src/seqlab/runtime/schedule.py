"""Learning-rate shape shared by every driver: linear warmup, then cosine decay to ``lr * min_ratio``.

A pure function of the step, so a schedule has no state to checkpoint: the step is enough to resume.
"""

from __future__ import annotations

import math


def cosine_decay(fraction: float, lr: float, min_ratio: float) -> float:
    """The cosine from ``lr`` (fraction 0) down to ``lr * min_ratio`` (fraction 1); fraction is clamped."""
    fraction = min(max(fraction, 0.0), 1.0)
    lo = lr * min_ratio
    return lo + 0.5 * (1.0 + math.cos(math.pi * fraction)) * (lr - lo)


def warmup_cosine(step: int, total: int, lr: float, warmup: int, min_ratio: float) -> float:
    """Learning rate for 0-based ``step``: warmup over ``warmup`` steps, then cosine until ``step == total``.

    Warmup starts at ``lr / (warmup + 1)`` rather than 0 so that the first update is never wasted.
    """
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    return cosine_decay((step - warmup) / max(1, total - warmup), lr, min_ratio)

"""The whole-pass check: do the chosen routes still win when every converted product runs once, in order?

Why: calibration times one product shape at a time, repeatedly, on one layer whose weight stays in the caches. A
decode step streams every layer's weight from memory once, so a route that wins hot can lose cold (measured under
AVX2 caps on an AVX-512 Xeon: each packed shape won by more than 5 % alone, and the whole step ran 2-5 % slower).
So :func:`seqlab.accel.accelerate` times one pass over the layers it converts, before and after, and keeps the routes
only when they win there too; the verdict is cached beside the per-shape timings.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import torch
from torch import nn

from seqlab.accel.routes import Use

# each side of the check runs for about this long (more rounds on small models, at least MIN_ROUNDS)
PASS_BUDGET_S = 0.5
MIN_ROUNDS, MAX_ROUNDS = 3, 20


def pass_key(use: Use, routes: list[tuple[int, int, bool, str]]) -> str:
    """Cache key of one whole-pass verdict: the use and the (shape, route) of every product, in order."""
    digest = hashlib.sha1(repr(routes).encode()).hexdigest()[:16]
    return f"pass|{use.for_}|{str(use.dtype).removeprefix('torch.')}|rows={use.rows}|{digest}"


def time_pass(layers: list[nn.Module], use: Use, budget_s: float = PASS_BUDGET_S,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds for one pass over ``layers`` (each product once, ``use.rows`` rows), best of several rounds."""
    inputs = {m.in_features: torch.randn(use.rows, m.in_features, dtype=use.dtype) for m in layers}

    def one_pass() -> float:
        t0 = clock()
        for m in layers:
            m(inputs[m.in_features])
        return clock() - t0

    with torch.inference_mode():
        first = one_pass()  # also the warm-up: first calls set up kernels and primitives
        rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, int(budget_s / max(first, 1e-6))))
        # the minimum: other processes only ever add time, so the fastest pass is the products' own speed
        return min(one_pass() for _ in range(rounds))

"""Does the fused decode step beat the plain one on this machine, for this model and row count? Timed, cached.

Why a whole step, timed on the model itself: the fused step replaces every op of a decode step at once, so only a
whole step says whether it wins (at one row it streams the same weights as the plain step, and wins by the ops it
removes; at many rows the products become compute-bound and the plain GEMMs may win). The verdict is cached
beside the per-shape timings (same CPU signature), keyed by the model's shapes, weight formats and the library.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import torch
from torch import nn

from seqlab.accel import fused_step
from seqlab.accel.calibrate import cached_timings, fastest
from seqlab.generate.engine import decode_step, prefill
from seqlab.runtime import native

PLAIN = "plain"
STEP_BUDGET_S = 0.4  # about this long per candidate, over ROUNDS interleaved rounds
ROUNDS, PROMPT, MAX_STEPS = 3, 16, 64  # the cache holds PROMPT + MAX_STEPS positions, not the whole context


def step_key(model: nn.Module, rows: int) -> str:
    """Cache key: the use, the model's shapes and weight formats, and the fused library's source."""
    cfg = model.config
    kinds = [(n, fused_step._mat_kind(m), getattr(m, "group_size", 0)) for n, m in fused_step._linears(model)]
    dims = (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size,
            cfg.qk_norm, cfg.qkv_bias, cfg.bias, cfg.lm_head_bias)
    blob = repr((dims, kinds, native.source_key(fused_step.SOURCES))).encode()
    return f"step|decode|rows={rows}|{hashlib.sha1(blob).hexdigest()[:16]}"


def time_steps(model: nn.Module, rows: int, steps: dict[str, Callable], budget_s: float = STEP_BUDGET_S,
               clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Seconds per decode step of each candidate (best of interleaved rounds) on a cache of ``rows`` rows."""
    prompt = max(1, min(PROMPT, model.config.max_seq_len // 2))
    room = min(MAX_STEPS, model.config.max_seq_len - prompt)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (rows, prompt), generator=g)
    with torch.inference_mode():
        cache = model.new_cache(rows, prompt + room)  # a whole-context cache of a real model is hundreds of MiB
        tok = prefill(model, ids, cache).argmax(-1)

        def one(step: Callable, n: int) -> float:
            cache.crop(prompt)
            t0 = clock()
            for _ in range(n):
                step(tok, cache)
            return (clock() - t0) / n

        first = {name: one(step, 1) for name, step in steps.items()}  # also the warm-up
        n = max(1, min(room, int(budget_s / ROUNDS / max(max(first.values()), 1e-6))))
        best = dict.fromkeys(steps, float("inf"))
        for _ in range(ROUNDS):
            for name, step in steps.items():  # interleaved: a busy phase of a shared machine hits every candidate
                best[name] = min(best[name], one(step, n))
    return best


def choose_fused(model: nn.Module, rows: int, use_cache: bool = True) -> tuple[fused_step.FusedDecodeStep | None,
                                                                               dict[str, float]]:
    """The fused step to install (None: the plain step is as fast, or the model is not supported), and the timings."""
    if fused_step.unsupported(model):
        return None, {}
    isas = fused_step.available_isas()
    if not isas:
        return None, {}
    candidates = {isa: fused_step.FusedDecodeStep(model, isa) for isa in isas}
    steps = {PLAIN: lambda t, c: decode_step(model, t, c), **candidates}
    timings = cached_timings(step_key(model, rows), lambda: time_steps(model, rows, steps), use_cache,
                             required=list(steps))
    best = fastest({k: v for k, v in timings.items() if k == PLAIN or k in candidates}, plain=PLAIN)
    return candidates.get(best), timings

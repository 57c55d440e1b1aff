"""bf16 prefill for an fp32 model, where the CPU has native bf16 and a timed prefill says it pays.

Why: a prefill is a chain of matrix products with hundreds of rows, so it is compute-bound, and on a CPU with
AMX-BF16 a bf16 product runs several times faster than fp32 (about 3.5x measured on a 2-core Xeon). The decode
steps after it stream the weights once per token and stay fp32, so the weights stay fp32 (no second copy): the
prefill runs under ``torch.autocast`` (products in bf16, norms and the residual stream in fp32) and the fp32 cache
takes its keys and values. It changes the numbers (bf16 keeps about 3 significant digits), which is why ``"auto"``
only takes it where it is clearly faster, and ``--dtype fp32`` never does; docs/acceleration.md states the quality.

Short prompts stay fp32: autocast converts every weight at every call, which a few-token prefill cannot repay. The
shortest prompt length that wins is measured (``LENGTHS``) and cached per CPU signature and model shape.
"""
from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from seqlab.accel.calibrate import load_cache, store_cache
from seqlab.generate.engine import prefill
from seqlab.runtime.cpu import current_signature, native_bf16

LENGTHS = (64, 128, 256)  # prompt lengths timed, shortest first: the first that wins sets the threshold
MIN_SPEEDUP = 1.25  # as for bf16 decode (seqlab.accel.apply.BF16_MIN_SPEEDUP): only where clearly faster
ROUNDS = 3


@dataclass(frozen=True)
class PrefillCast:
    """Run prefills of at least ``min_tokens`` tokens (rows x length) with products in ``dtype``."""

    dtype: torch.dtype
    min_tokens: int

    def context(self, n_tokens: int) -> contextlib.AbstractContextManager:
        if n_tokens < self.min_tokens:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=self.dtype)


def prefill_key(model: nn.Module) -> str:
    cfg = model.config
    dims = (cfg.arch, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size,
            cfg.mlp, cfg.norm)
    return f"prefill|bf16|{hashlib.sha1(repr(dims).encode()).hexdigest()[:16]}"


def time_prefills(model: nn.Module, length: int, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Seconds per ``length``-token prefill, fp32 and under bf16 autocast (best of interleaved rounds)."""
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    cast = PrefillCast(torch.bfloat16, 0)
    best = {"fp32": float("inf"), "bf16": float("inf")}
    with torch.inference_mode():
        for r in range(ROUNDS + 1):  # round 0 is the warm-up (oneDNN primitives are made on first use)
            for name in best:
                cache = model.new_cache(1, length)
                t0 = clock()
                with cast.context(length) if name == "bf16" else contextlib.nullcontext():
                    prefill(model, ids, cache)
                if r:
                    best[name] = min(best[name], clock() - t0)
    return best


def choose_prefill_cast(model: nn.Module, use_cache: bool = True) -> tuple[PrefillCast | None, dict[str, float]]:
    """The bf16 prefill policy for an fp32 ``model`` (None where bf16 is not native or never wins), and the
    timings (``"fp32@L"`` / ``"bf16@L"`` seconds per prefill of L tokens)."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    if not native_bf16() or not params or params[0].dtype != torch.float32 or params[0].device.type != "cpu":
        return None, {}
    key, sig = prefill_key(model), current_signature()
    timings = dict(load_cache(sig).get(key, {})) if use_cache else {}
    if not timings:
        for length in LENGTHS:
            if length > model.config.max_seq_len:
                break
            t = time_prefills(model, length)
            timings |= {f"fp32@{length}": t["fp32"], f"bf16@{length}": t["bf16"]}
            if t["bf16"] * MIN_SPEEDUP <= t["fp32"]:
                break  # the shortest winning length sets the threshold; longer prompts only gain more
        if use_cache:
            timings = dict(store_cache(sig, {key: timings})[key])
    for length in LENGTHS:
        fp32, bf16 = timings.get(f"fp32@{length}"), timings.get(f"bf16@{length}")
        if fp32 is not None and bf16 is not None and bf16 * MIN_SPEEDUP <= fp32:
            return PrefillCast(torch.bfloat16, length), timings
    return None, timings

"""The prefill's product route for an fp32 model: plain MKL, fp32 on oneDNN, or bf16 where it is native; timed.

Why: a prefill is a chain of matrix products with hundreds of rows, so it is compute-bound, and which library or
dtype computes them fastest depends on the CPU. On a Xeon with AMX-BF16 a bf16 product runs several times faster
than fp32 (about 3.5x on two cores); on an AMD EPYC, MKL's fp32 products run at half oneDNN's rate on the same
shapes (1.9-2.4x measured at 64-512 rows), while under the AVX2 caps the two tie. The decode steps after the
prefill keep their own route, and the weights stay fp32 (no second copy):

- ``fp32`` on oneDNN (:func:`onednn_products`, through each layer's :class:`RoutedForward`): the same products,
  another summation order, so the logits agree with MKL's to fp32 rounding. Taken under ``--dtype fp32`` too,
  wherever it measures faster.
- ``bf16`` (``torch.autocast``: products in bf16, norms and the residual stream in fp32; the fp32 cache takes its
  keys and values). It changes the numbers (bf16 keeps about 3 significant digits), which is why only ``"auto"``
  takes it, only where native, and only where it beats the best fp32 route by ``MIN_SPEEDUP``;
  docs/acceleration.md states the quality.

Short prompts stay on the plain route (autocast converts every weight at every call, which a few-token prefill
cannot repay). Each of ``LENGTHS`` is timed on every route once per CPU signature and model shape (cached); its
winner takes the prompts from that length on, so the route may change with the length, and the longest length's
winner runs every longer prompt.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqlab.accel.calibrate import best_of_rounds, cached_timings, timings_by_size
from seqlab.accel.pointwise import installed as installed_pointwise
from seqlab.accel.pointwise import sources as pointwise_sources
from seqlab.accel.train_linear import onednn_linear, plain_fp32_product, train_route_available
from seqlab.generate.engine import prefill
from seqlab.model.cache import KVCache
from seqlab.quant import QuantLinear
from seqlab.runtime import native
from seqlab.runtime.cpu import native_bf16

# Prompt lengths timed: each one's winner takes the prompts from it to the next, the last one's every longer prompt.
# 512 is timed on every route, whatever 256 chose, since the margins move with the length both ways: on a Zen 3
# EPYC a prefill on oneDNN led plain MKL at 256 tokens and trailed it at 512; on a Zen 4 under the AVX2 caps it led
# by 8 % at 256 and by 12 % at 512. Two prefills of each route at 512 (best of two): about 3-4 s on SmolLM2.
LENGTHS = (64, 256, 512)
MIN_SPEEDUP = 1.25  # bf16, as for bf16 decode (seqlab.accel.apply.BF16_MIN_SPEEDUP): only where clearly faster
# fp32 on oneDNN changes only the rounding, so a margin just over the timings' noise suffices. 1.1 missed real gains:
# on a Zen 4 under the AVX2 caps oneDNN's SmolLM2 prefill led MKL's by 5-19 % in twelve calibrations (a forced
# oneDNN route took 7-12 % off the 512-token TTFT), and 1.1 took it in four of them at 64 tokens.
ONEDNN_MIN_SPEEDUP = 1.05
# Best of 2, after a warm-up round at the first length only: at 256 and 512 tokens the first round measured within
# 1-3 % of the next two on every route (a Zen 4 EPYC, SmolLM2), which best-of-2 absorbs, and leaving those warm-ups
# out takes SmolLM2's prefill timing from about 10 to about 7 s once per CPU.
ROUNDS = 2


_ONEDNN: contextvars.ContextVar[bool] = contextvars.ContextVar("seqlab_prefill_onednn", default=False)


@contextlib.contextmanager
def onednn_products():
    """Within it (this thread or task only), inference products of the model's ``nn.Linear`` layers that
    :func:`install` routed run on oneDNN instead of MKL."""
    token = _ONEDNN.set(True)
    try:
        yield
    finally:
        _ONEDNN.reset(token)


class RoutedForward:
    """An ``nn.Linear``'s forward: ``F.linear``, or oneDNN's product within :func:`onednn_products`.

    Put on the layer as its ``forward`` (the layer stays an ``nn.Linear`` with the same Parameters, which the
    fused decode step reads) rather than switched by a TorchFunctionMode around the pass: a mode costs a Python
    call on every op and every tensor attribute read of the prefill, about 2 ms of a 512-token one here."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear

    def __call__(self, x: Tensor) -> Tensor:
        m = self.linear
        if not torch.compiler.is_compiling() and _ONEDNN.get() and _onednn_inference_product(x, m.weight, m.bias):
            return onednn_linear(x, m.weight, m.bias)
        return F.linear(x, m.weight, m.bias)


def _onednn_inference_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    return not needs_grad and plain_fp32_product(x, weight, bias)


def install(model: nn.Module) -> None:
    """Route every plain ``nn.Linear`` of ``model`` through :class:`RoutedForward`."""
    for m in model.modules():
        if type(m) is nn.Linear:
            m.forward = RoutedForward(m)


def uninstall(model: nn.Module) -> bool:
    """Take the switch off every layer; whether any had it."""
    routed = False
    for m in model.modules():
        if isinstance(m.__dict__.get("forward"), RoutedForward):
            del m.forward
            routed = True
    return routed


@dataclass(frozen=True)
class PrefillCast:
    """Run prefills of at least ``min_tokens`` tokens (rows x length) with products in ``dtype``: bf16 under
    autocast, fp32 on oneDNN, or None: the plain products (a step after one where the faster route stops winning);
    prompts of at least ``longer.min_tokens`` take ``longer``'s route instead. ``head_onednn`` (on the first
    step): the LM head's product of the prompts' last positions runs on oneDNN, where that timed faster."""

    dtype: torch.dtype | None
    min_tokens: int
    longer: PrefillCast | None = None
    head_onednn: bool = False

    def context(self, n_tokens: int) -> contextlib.AbstractContextManager:
        if self.longer is not None and n_tokens >= self.longer.min_tokens:
            return self.longer.context(n_tokens)
        if n_tokens < self.min_tokens or self.dtype is None:
            return contextlib.nullcontext()
        if self.dtype == torch.float32:
            return onednn_products()
        return torch.autocast("cpu", dtype=self.dtype)

    def head_context(self, n_tokens: int) -> contextlib.AbstractContextManager:
        """The LM head's product of each prompt's last position (a few rows against the whole head weight, so it
        streams the weight): on oneDNN where that timed faster for this head (:func:`time_head`), whatever the
        body's route (bf16 would convert the whole head weight for those few rows); plain otherwise."""
        if n_tokens < self.min_tokens or not self.head_onednn:
            return contextlib.nullcontext()
        return onednn_products()

    @property
    def route(self) -> str:
        return {None: "plain fp32", torch.float32: "fp32 on oneDNN"}.get(self.dtype, "bf16")

    def route_for(self, n_tokens: int) -> str:
        """The route a prefill of ``n_tokens`` tokens takes along the chain (as :meth:`context` picks it)."""
        if self.longer is not None and n_tokens >= self.longer.min_tokens:
            return self.longer.route_for(n_tokens)
        return self.route if n_tokens >= self.min_tokens else "plain fp32"

    @property
    def label(self) -> str:
        """``"64+ tokens in fp32 on oneDNN, 256+ in bf16"`` (``"; the head on oneDNN"`` where it is)."""
        steps, cast = [], self
        while cast is not None:
            steps.append(f"{cast.min_tokens}+ tokens in {cast.route}" if not steps
                         else f"{cast.min_tokens}+ in {cast.route}")
            cast = cast.longer
        return ", ".join(steps) + ("; the head on oneDNN" if self.head_onednn else "")


def prefill_key(model: nn.Module, allow_bf16: bool = True) -> str:
    cfg = model.config
    dims = (cfg.arch, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size,
            cfg.mlp, cfg.norm)
    routes = "onednn+bf16" if allow_bf16 else "onednn"
    # the attention a prefill runs (seqlab.accel.prefill_attention) and the head's route are part of what is timed
    attention = getattr(model, "prefill_attention", None)
    extras = f"head|{attention.label + ', fp32 under autocast' if attention is not None else 'sdpa'}"
    kernels = installed_pointwise(model)  # and the norms, rotary and SwiGLU (seqlab.accel.pointwise)
    if kernels is not None:
        extras += f"|pointwise {kernels.isa} from {kernels.min_rows} {native.source_key(pointwise_sources())}"
    extras += "|no modes"  # timings taken inside TorchFunctionModes (before 2cffde3) are not reused
    schemes = Counter(f"int{m.bits} g{m.group_size}" for m in model.modules() if isinstance(m, QuantLinear))
    if schemes:  # quantised products run seqlab.quant's routes: a dense model's timings of these shapes say nothing
        extras += "|quantised " + ", ".join(f"{n} x{count}" for n, count in sorted(schemes.items()))
    # the lengths timed: an entry from before 512 was one of them, or from a shorter context, must not stand in
    lengths = ",".join(str(n) for n in LENGTHS if n <= cfg.max_seq_len)
    return f"prefill|{routes}|{extras}|lengths {lengths}|{hashlib.sha1(repr(dims).encode()).hexdigest()[:16]}"


def candidate_casts(allow_bf16: bool) -> dict[str, PrefillCast | None]:
    """The routes worth timing here: plain fp32 always, oneDNN's fp32 where torch has it, bf16 where native."""
    casts: dict[str, PrefillCast | None] = {"fp32": None}
    if train_route_available():
        casts["onednn"] = PrefillCast(torch.float32, 0)
    if allow_bf16 and native_bf16():
        casts["bf16"] = PrefillCast(torch.bfloat16, 0)
    return casts


def time_prefills(model: nn.Module, length: int, casts: dict[str, PrefillCast | None],
                  clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Seconds per ``length``-token prefill on each route in ``casts`` (best of interleaved rounds)."""
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))

    def run(cast: PrefillCast | None) -> Callable[[KVCache], Tensor]:
        def one(cache: KVCache) -> Tensor:
            with _installed(model, cast):  # the prefill exactly as it will run: body and head routes
                return prefill(model, ids, cache)
        return one

    with torch.inference_mode():
        return best_of_rounds({name: run(cast) for name, cast in casts.items()}, ROUNDS, clock,
                              setup=lambda name: model.new_cache(1, length), warm_up=length == LENGTHS[0])


def time_head(model: nn.Module, rounds: int = 5, clock: Callable[[], float] = time.perf_counter
              ) -> dict[str, float]:
    """Seconds per LM head product of one prompt's last position (``model.head`` on one row), plain (``"fp32"``)
    and on oneDNN (``"onednn"``), best of interleaved rounds after a warm-up. The head streams its whole weight for
    that row (32000 x 512 floats in the 6-layer bench model), which the two libraries do at different rates."""
    x = torch.randn(1, model.config.d_model, generator=torch.Generator().manual_seed(0))

    def run(route: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], Tensor]:
        def one() -> Tensor:
            with route():
                return model.head(x)
        return one

    with torch.inference_mode():
        return best_of_rounds({"fp32": run(contextlib.nullcontext), "onednn": run(onednn_products)}, rounds, clock)


@contextlib.contextmanager
def _installed(model: nn.Module, cast: PrefillCast | None):
    """``model.prefill_cast = cast`` (None: none) for the block; whatever was there before comes back."""
    before = model.__dict__.get("prefill_cast")
    if cast is None:
        model.__dict__.pop("prefill_cast", None)
    else:
        model.prefill_cast = cast
    try:
        yield
    finally:
        model.__dict__.pop("prefill_cast", None)
        if before is not None:
            model.prefill_cast = before


_ROUTE_NAMES = {None: "fp32", torch.float32: "onednn", torch.bfloat16: "bf16"}


def _winner(timings: dict[str, float], length: int, current: torch.dtype | None = None) -> torch.dtype | None:
    """The route for prompts of ``length`` tokens (None: plain): bf16 where it beats the best fp32 route by
    MIN_SPEEDUP, else oneDNN's fp32 where it beats MKL's by ONEDNN_MIN_SPEEDUP. The margins guard the choice of a
    route, not the keeping of one: the route of shorter prompts (``current``) goes on while it is the fastest
    route timed here (ties included), and gives way to the winner where another measures faster."""
    fp32, onednn, bf16 = (timings.get(f"{name}@{length}") for name in ("fp32", "onednn", "bf16"))
    if fp32 is None:
        return current
    onednn_wins = onednn is not None and onednn * ONEDNN_MIN_SPEEDUP <= fp32
    best_fp32 = onednn if onednn_wins else fp32
    winner = torch.bfloat16 if bf16 is not None and bf16 * MIN_SPEEDUP <= best_fp32 else (
        torch.float32 if onednn_wins else None)
    kept = timings.get(f"{_ROUTE_NAMES[current]}@{length}")
    timed = [t for t in (fp32, onednn, bf16) if t is not None]
    if current is not None and kept is not None and kept <= min(timed):
        return current
    return winner


def choose_prefill_cast(model: nn.Module, use_cache: bool = True, allow_bf16: bool = True
                        ) -> tuple[PrefillCast | None, dict[str, float]]:
    """The prefill routes for an fp32 ``model`` (None: plain products for every prompt), and the timings
    (``"fp32@L"``, ``"onednn@L"``, ``"bf16@L"``: seconds per prefill of L tokens). ``allow_bf16=False`` (an explicit
    fp32 request) leaves only the fp32 routes. Where the winner changes with the length (an EPYC: oneDNN's fp32 at
    64 tokens, bf16 from 256), the cast chains them."""
    params = [p for p in model.parameters() if p.is_floating_point()]
    casts = candidate_casts(allow_bf16)
    if not any(type(m) is nn.Linear for m in model.modules()):
        casts.pop("onednn", None)  # no layer it could route (a quantised model): it would time plain products again
    if len(casts) < 2 or not params or params[0].dtype != torch.float32 or params[0].device.type != "cpu":
        return None, {}
    install(model)  # the layers' oneDNN switch, before anything is timed
    lengths = [n for n in LENGTHS if n <= model.config.max_seq_len]
    key = prefill_key(model, allow_bf16)
    timings = timings_by_size(key, lengths, lambda n: time_prefills(model, n, casts), use_cache, names=list(casts))
    steps: list[PrefillCast] = []
    for length in LENGTHS:
        dtype = _winner(timings, length, steps[-1].dtype if steps else None)
        if dtype != (steps[-1].dtype if steps else None):
            steps.append(PrefillCast(dtype, length))  # a faster route from here on, or plain where it stops winning
    chained = None
    for cast in reversed(steps):
        chained = PrefillCast(cast.dtype, cast.min_tokens, chained)
    if chained is not None and "onednn" in casts:  # the head's product, timed on its own (one row, its weight)
        head = cached_timings(f"head|{key}", lambda: time_head(model), use_cache, required=["onednn", "fp32"])
        timings = {**timings, **{f"head {name}": t for name, t in head.items()}}
        if head["onednn"] * ONEDNN_MIN_SPEEDUP <= head["fp32"]:
            chained = dataclasses.replace(chained, head_onednn=True)
    if all(cast.dtype != torch.float32 for cast in steps) and not (chained and chained.head_onednn):
        uninstall(model)  # no fp32 product on oneDNN: the layers stay plain
    return chained, timings

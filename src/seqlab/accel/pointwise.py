"""A prefill's RMSNorm, rotary and SwiGLU, each in one C pass (``pointwise.c``), where that times faster.

Why: torch computes each of the three as a chain of ops over the whole activation (RMSNorm: norm, scale, weight;
rotary: negate, concatenate, two products, a sum; SwiGLU: SiLU, then a product). Once a prefill's products and
attention run near the CPU's peak, those chains are what is left: removing all three from the 6-layer bench model's
512-token prefill saved about 9 % (measured by ablation under the AVX2 caps), and one pass each saves most of it.

The model keeps its math in plain functions (:func:`~seqlab.model.layers.rms_norm`,
:func:`~seqlab.model.layers.apply_rotary`, :func:`~seqlab.model.layers.gated_activation`) held in attributes of its
modules (``normalize``, ``rotate``, ``gate``); :func:`install` puts these kernels there, and :func:`uninstall`
puts the functions back. Each kernel takes only fp32 CPU tensors that need no gradient, with rows it can address by
one stride, and at least ``min_rows`` rows (timed, :func:`choose_pointwise`); anything else goes to the function it
replaced. Rotary is bitwise torch's; RMSNorm sums its squares in another order and SwiGLU's ``exp`` is a 2-ulp
polynomial, so those two agree with torch to fp32 rounding.
"""
from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqlab.accel.calibrate import best_of_rounds, timings_by_size, winning_from
from seqlab.model.attention import SelfAttention
from seqlab.model.layers import MLP, RMSNorm, apply_rotary, gated_activation, rms_norm
from seqlab.runtime import native

SOURCE = Path(__file__).with_name("pointwise.c")
SIMD = Path(__file__).with_name("simd.h")
ROWS = (1, 16, 64, 256)  # rows timed: the kernels take calls from the fewest rows they win from on
MIN_SPEEDUP = 1.1  # only the rounding changes (rotary: not even that): a clear margin over timing noise suffices
ROUNDS = 5
_PLAIN = (Tensor, nn.Parameter)  # not subclasses (fake, distributed or wrapped tensors): their data is not theirs


def library(isa: str) -> ctypes.CDLL | None:
    """The kernels built for ``isa`` ("avx2" or "avx512"), or None where they cannot be built or run here."""
    return native.optional_library("pointwise", SOURCE, isa, [SIMD], _signatures, "seqlab.accel: pointwise kernels")


def _signatures(dll: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    dll.seqlab_rms_norm.argtypes = [p, i64, p, p, i64, i64, f32, i32]
    dll.seqlab_rotary.argtypes = [p, i64, p, p, p, i64, i64, i64, i32]
    dll.seqlab_swiglu.argtypes = [p, i64, p, i64, i64, i32]
    for fn in (dll.seqlab_rms_norm, dll.seqlab_rotary, dll.seqlab_swiglu):
        fn.restype = None


def available_isas() -> list[str]:
    return native.runnable_isas(library)


def sources() -> list[Path]:
    """The files the kernels are built from (their hash is part of every timing kept for them)."""
    return [SOURCE, SIMD]


def _rows(x: Tensor, min_rows: int) -> Tensor | None:
    """``x`` as a [rows, width] view with one row stride, where a kernel may take it; else None."""
    if (torch.compiler.is_compiling() or type(x) not in _PLAIN or x.dtype != torch.float32
            or x.device.type != "cpu" or x.dim() < 2 or x.stride(-1) != 1
            or (x.requires_grad and torch.is_grad_enabled())):
        return None
    try:
        rows = x.view(-1, x.shape[-1])
    except RuntimeError:  # leading dimensions that one stride cannot walk (e.g. a head slice of q and k)
        return None
    return rows if rows.shape[0] >= max(min_rows, 1) else None


@dataclass(frozen=True)
class Kernels:
    """The three replacements, on one build, for calls of at least ``min_rows`` rows."""

    isa: str
    min_rows: int

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        rows = _rows(x, self.min_rows)
        weight_fits = (type(weight) in _PLAIN and weight.dtype == torch.float32 and weight.device.type == "cpu"
                       and weight.shape == x.shape[-1:])
        if rows is None or not weight_fits or (weight.requires_grad and torch.is_grad_enabled()):
            return rms_norm(x, weight, eps)
        w = weight.contiguous()
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        library(self.isa).seqlab_rms_norm(rows.data_ptr(), rows.stride(0), w.data_ptr(), y.data_ptr(),
                                          rows.shape[0], rows.shape[1], eps, torch.get_num_threads())
        return y

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, T, heads, D] by cos, sin [B, T, 1, D] (the model's layout; anything else: torch's)."""
        if x.dim() != 4 or x.shape[-1] % 2 or cos.shape != sin.shape or cos.shape != (*x.shape[:2], 1, x.shape[3]):
            return apply_rotary(x, cos, sin)
        B, T, heads, D = x.shape
        positions = _rows(x.flatten(2) if x.stride(2) == D else x, self.min_rows)
        c, s = _rows(cos.reshape(B * T, D), 0), _rows(sin.reshape(B * T, D), 0)
        if positions is None or positions.shape[0] != B * T or c is None or s is None or not (
                c.is_contiguous() and s.is_contiguous()):
            return apply_rotary(x, cos, sin)
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        library(self.isa).seqlab_rotary(positions.data_ptr(), positions.stride(0), c.data_ptr(), s.data_ptr(),
                                        y.data_ptr(), B * T, heads, D, torch.get_num_threads())
        return y

    def gate(self, act: Callable[[Tensor], Tensor], h: Tensor, d_ff: int) -> Tensor:
        rows = _rows(h, self.min_rows) if act is F.silu and h.shape[-1] == 2 * d_ff else None
        if rows is None:
            return gated_activation(act, h, d_ff)
        y = torch.empty(*h.shape[:-1], d_ff, dtype=h.dtype, device=h.device)
        library(self.isa).seqlab_swiglu(rows.data_ptr(), rows.stride(0), y.data_ptr(), rows.shape[0], d_ff,
                                        torch.get_num_threads())
        return y


def install(model: nn.Module, kernels: Kernels) -> None:
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.normalize = kernels.rms_norm
        elif isinstance(m, SelfAttention):
            m.rotate = kernels.rotate
        elif isinstance(m, MLP):
            m.gate = kernels.gate


def uninstall(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.normalize = rms_norm
        elif isinstance(m, SelfAttention):
            m.rotate = apply_rotary
        elif isinstance(m, MLP):
            m.gate = gated_activation


def installed(model: nn.Module) -> Kernels | None:
    """The kernels :func:`install` put into ``model``, if any."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            owner = getattr(m.normalize, "__self__", None)
            return owner if isinstance(owner, Kernels) else None
    return None


def time_pointwise(d_model: int, n_heads: int, n_kv: int, head_dim: int, d_ff: int, rows: int,
                   isas: list[str], clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Seconds for one layer's two norms, rotary and SwiGLU over ``rows`` positions: ``"torch"`` and each build
    (best of interleaved rounds after a warm-up), on random inputs laid out as the model lays them out."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, rows, d_model, generator=g)
    weight = torch.rand(d_model, generator=g) + 0.5
    qk = torch.randn(1, rows, n_heads + 2 * n_kv, head_dim, generator=g)[:, :, :n_heads + n_kv]
    angles = torch.rand(1, rows, 1, head_dim, generator=g) * 6.0
    cos, sin = angles.cos(), angles.sin()
    h = torch.randn(1, rows, 2 * d_ff, generator=g)

    def layer(norm, rotate, gate) -> None:
        norm(x, weight, 1e-5), rotate(qk, cos, sin), norm(x, weight, 1e-5), gate(F.silu, h, d_ff)

    runs = {"torch": lambda: layer(rms_norm, apply_rotary, gated_activation)}
    for isa in isas:
        k = Kernels(isa, 0)
        runs[isa] = lambda k=k: layer(k.rms_norm, k.rotate, k.gate)
    with torch.inference_mode():
        return best_of_rounds(runs, ROUNDS, clock)


def choose_pointwise(model: nn.Module, use_cache: bool = True) -> tuple[Kernels | None, dict[str, float]]:
    """Time torch's three chains against each build at ``ROWS``, once per CPU signature and model shape (cached).
    The fastest build takes calls from the fewest rows from which it beats torch by ``MIN_SPEEDUP`` at that and
    every larger timed count; None where it never does."""
    cfg = model.config
    isas = available_isas() if cfg.mlp == "swiglu" and cfg.norm == "rmsnorm" else []
    if not isas:
        return None, {}
    shape = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff)
    key = (f"pointwise|{'x'.join(map(str, shape))}|{'+'.join(isas)}|{'+'.join(map(str, ROWS))}|"
           f"{native.source_key(sources())}")
    timings = timings_by_size(key, ROWS, lambda n: time_pointwise(*shape, n, isas), use_cache,
                              names=[*isas, "torch"])
    isa, min_rows = winning_from(timings, isas, ROWS, "torch", MIN_SPEEDUP)
    return (Kernels(isa, min_rows) if min_rows is not None else None), timings

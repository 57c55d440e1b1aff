"""Causal self-attention for a long prefill in one C call (``prefill_attention.c``), where it times faster.

Why: once a prefill's products run near the CPU's matmul peak, SDPA's CPU flash attention is the largest piece
left, and it runs well below that peak: it works through small blocks with a running (online) softmax. A prompt
of a few thousand tokens fits a whole score row per query in cache, so this kernel computes each block of queries'
scores in one register-tiled product, takes the exact softmax, and multiplies by V. Same arithmetic, another
summation order and a polynomial ``exp`` (2 ulp): outputs agree with SDPA's to fp32 rounding (bf16 outputs: to
one bf16 rounding; bf16 inputs are widened once and computed in fp32).

It takes only what it was built for (:func:`takes`): fp32 or bf16 CPU tensors, no gradient, ``is_causal`` with
as many queries as keys and no mask, no dropout, a head dimension the tiles divide. Under autocast (the bf16 prefill
route) bf16 inputs are widened first, so that attention runs in fp32. Anything else goes to SDPA unchanged.
:func:`install` puts it into the model's self-attention layers (``attend``, SDPA by default).
Whether it runs at all is decided by timing (:func:`choose_attention`), per CPU signature, attention shape and
dtype; docs/acceleration.md has the measurements.
"""
from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqlab.accel.calibrate import best_of_rounds, timings_by_size, winning_from
from seqlab.model.attention import SelfAttention
from seqlab.runtime import native

SOURCE = Path(__file__).with_name("prefill_attention.c")
SIMD = Path(__file__).with_name("simd.h")
TILES = Path(__file__).with_name("attention_tiles.h")
HEAD_DIM_MULTIPLE = 32  # the kernel's column tile in the AVX-512 build (16 in the AVX2 one)
DTYPES = (torch.float32, torch.bfloat16)  # bf16 values are widened once and computed in fp32, the output rounded once
LENGTHS = (64, 256, 1024)  # prompt lengths timed: the kernel takes prompts from the shortest length it wins from on
MIN_SPEEDUP = 1.1  # only the rounding changes: a clear margin over timing noise suffices
ROUNDS = 5
i64 = ctypes.c_int64


class _Attention(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("batch", i64), ("n_heads", i64), ("n_kv", i64), ("len", i64), ("head_dim", i64),
                ("q_strides", i64 * 3), ("k_strides", i64 * 3), ("v_strides", i64 * 3), ("out_strides", i64 * 3),
                ("scale", ctypes.c_float), ("bf16", i64), ("lse", ctypes.c_void_p)]


def library(isa: str) -> ctypes.CDLL | None:
    """The kernel built for ``isa`` ("avx2" or "avx512"), or None where it cannot be built or run here."""
    return native.optional_library("prefill_attention", SOURCE, isa, [SIMD, TILES], _signatures,
                                   "seqlab.accel: prefill attention kernel")


def _signatures(dll: ctypes.CDLL) -> None:
    dll.seqlab_causal_attention.argtypes = [ctypes.POINTER(_Attention), ctypes.c_int]
    dll.seqlab_causal_attention.restype = ctypes.c_int


def available_isas() -> list[str]:
    return native.runnable_isas(library)


def takes(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
          is_causal: bool = False, mixed_dtypes: bool = False) -> bool:
    """Whether the kernel computes this SDPA call (else SDPA does). ``mixed_dtypes``: q, k and v may differ
    among fp32 and bf16 (the caller widens them first)."""
    if attn_mask is not None or not is_causal or dropout_p != 0.0 or not q.dim() == k.dim() == v.dim() == 4:
        return False
    if any(t.dtype not in DTYPES or (t.dtype != q.dtype and not mixed_dtypes) or t.device.type != "cpu"
           or t.stride(-1) != 1 or t.requires_grad or type(t) is not Tensor for t in (q, k, v)):
        return False
    (B, H, T, D), (Bk, G, Tk, Dk) = q.shape, k.shape
    return (T > 0 and G > 0 and D > 0 and (Bk, Tk, Dk) == (B, T, D) and tuple(v.shape) == (B, G, T, D)
            and H % G == 0 and D % HEAD_DIM_MULTIPLE == 0)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, isa: str = "avx2",
                     lse: Tensor | None = None) -> Tensor | None:
    """SDPA's ``is_causal`` result for ``q`` [B, H, T, D] and ``k``, ``v`` [B, G, T, D] (G divides H), computed by
    the kernel; None where it declined (the caller falls back to SDPA). The result is a [B, H, T, D] view of a
    [B, T, H, D] tensor, so the usual ``transpose(1, 2).reshape(B, T, H * D)`` after attention is free. ``lse``
    (contiguous fp32 [B, H, T]), where given, receives each row's log-sum-exp of its scaled scores."""
    lib = library(isa)
    if lib is None:
        return None
    B, H, T, D = q.shape
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    view = out.transpose(1, 2)
    desc = _Attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), B, H, k.shape[1], T, D,
                      (i64 * 3)(*q.stride()[:3]), (i64 * 3)(*k.stride()[:3]), (i64 * 3)(*v.stride()[:3]),
                      (i64 * 3)(*view.stride()[:3]), 1.0 / math.sqrt(D) if scale is None else scale,
                      int(q.dtype == torch.bfloat16), None if lse is None else lse.data_ptr())
    return view if lib.seqlab_causal_attention(ctypes.byref(desc), torch.get_num_threads()) == 0 else None


class PrefillAttention:
    """SDPA's signature; the calls the kernel :func:`takes` of at least ``min_len`` queries run on the ``isa``
    build, the rest on SDPA. :func:`install` puts it where the model's self-attention calls SDPA (a callable
    there, not a mode around the pass: a TorchFunctionMode costs a Python call on every op of the prefill)."""

    def __init__(self, min_len: int, isa: str):
        self.min_len, self.isa = min_len, isa

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False) -> Tensor:
        out = self._attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if out is not None:
            return out
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, dropout_p: float,
                is_causal: bool, scale: float | None, enable_gqa: bool) -> Tensor | None:
        """None: SDPA computes it (its own errors included)."""
        if torch.compiler.is_compiling() or query.dim() != 4 or query.shape[2] < self.min_len:
            return None
        if torch.is_autocast_enabled("cpu"):  # the bf16 prefill route: its products ran in bf16, and the keys and
            # values sit in the fp32 cache; the attention runs in fp32 (SDPA would round all three to bf16 first)
            query, key, value = (t.float() if t.dtype == torch.bfloat16 else t for t in (query, key, value))
        if not takes(query, key, value, attn_mask, dropout_p, is_causal):
            return None
        if key.shape[1] != query.shape[1] and not enable_gqa:
            return None
        return causal_attention(query, key, value, scale, self.isa)


@dataclass(frozen=True)
class AttentionChoice:
    """The kernel's build and the prompt length it takes over from (None: SDPA everywhere), with the timings."""

    isa: str | None
    min_len: int
    timings_s: dict[str, float]

    @property
    def label(self) -> str:
        return f"{self.min_len}+ tokens on seqlab's kernel ({self.isa})" if self.isa else "SDPA"


def install(model: nn.Module, choice: AttentionChoice) -> None:
    """Put the chosen kernel into every self-attention of ``model`` (nothing where SDPA was chosen)."""
    if choice.isa is None:
        return
    kernel = PrefillAttention(choice.min_len, choice.isa)
    for m in model.modules():
        if isinstance(m, SelfAttention):
            m.attend = kernel


def uninstall(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, SelfAttention):
            m.attend = F.scaled_dot_product_attention


def time_attention(n_heads: int, n_kv: int, head_dim: int, length: int, isas: list[str],
                   dtype: torch.dtype = torch.float32, clock: Callable[[], float] = time.perf_counter
                   ) -> dict[str, float]:
    """Seconds per causal attention of one ``length``-token prompt: ``"sdpa"`` and each kernel build (best of
    interleaved rounds after a warm-up), on random inputs laid out as the model lays them out."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, length, n_heads + 2 * n_kv, head_dim, generator=g).to(dtype)
    q, k, v = (t.transpose(1, 2) for t in qkv.split((n_heads, n_kv, n_kv), dim=2))
    k, v = k.contiguous(), v.contiguous()  # the cache's layout
    runs: dict[str, Callable[[], object]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_heads != n_kv)}
    for isa in isas:
        runs[isa] = lambda isa=isa: causal_attention(q, k, v, isa=isa)
    with torch.inference_mode():  # a build that declined (None: out of memory) gives no sample
        return best_of_rounds(runs, ROUNDS, clock, declined=lambda out: out is None)


def attention_key(n_heads: int, n_kv: int, head_dim: int, isas: list[str], lengths: list[int],
                  dtype: torch.dtype = torch.float32) -> str:
    """The shape and dtype, the builds, the lengths timed (they depend on the model's longest prompt) and the
    kernel's source."""
    return (f"prefill-attention|{n_heads}x{n_kv}x{head_dim}|{str(dtype).removeprefix('torch.')}|{'+'.join(isas)}|"
            f"{'+'.join(map(str, lengths))}|{native.source_key([SOURCE, SIMD, TILES])}")


def choose_attention(n_heads: int, n_kv: int, head_dim: int, max_len: int, use_cache: bool = True,
                     dtype: torch.dtype = torch.float32) -> AttentionChoice:
    """Time SDPA against each kernel build at ``LENGTHS`` (up to ``max_len``), once per CPU signature and shape
    (cached). The fastest build takes prompts from the shortest length from which it beats SDPA by
    ``MIN_SPEEDUP`` at that and every longer timed length; longer prompts follow the longest one's verdict."""
    isas = available_isas() if head_dim % HEAD_DIM_MULTIPLE == 0 and dtype in DTYPES else []
    if not isas:
        return AttentionChoice(None, 0, {})
    lengths = [n for n in LENGTHS if n <= max_len]
    if not lengths:
        return AttentionChoice(None, 0, {})
    key = attention_key(n_heads, n_kv, head_dim, isas, lengths, dtype)
    timings = timings_by_size(key, lengths, lambda n: time_attention(n_heads, n_kv, head_dim, n, isas, dtype),
                              use_cache, names=[*isas, "sdpa"])
    isa, min_len = winning_from(timings, isas, lengths, "sdpa", MIN_SPEEDUP)
    return AttentionChoice(isa if min_len is not None else None, min_len or 0, timings)

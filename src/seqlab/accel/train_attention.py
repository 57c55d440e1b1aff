"""Causal self-attention for training, forward and backward in C, where it times faster than SDPA's.

Why: once a training step's products run near the CPU's matmul peak, SDPA's CPU flash attention is a large part
of what is left (docs/acceleration.md has the shares). Its blocks are small and its backward recomputes them with
a running softmax.
Here the forward is the prefill kernel (``prefill_attention.c``), which also keeps each row's log-sum-exp, and
the backward (``attention_backward.c``) recomputes each block of query rows' probabilities from it once and
takes the three gradient products in register tiles over the causal half only. Same math as SDPA's (another
summation order, a polynomial ``exp``): gradients agree to fp32 rounding. bf16 inputs (autocast) are widened to
fp32 first and the output rounded once, as in the prefill.

It takes only what it was built for (:func:`trainable`), and everything else goes to SDPA: a causal call with
as many queries as keys, no mask, no dropout, a head width the tiles divide, and autograd recording. Whether it
runs at all is decided by timing forward + backward against SDPA's on the model's own attention shape, batch and
sequence length (:func:`choose_train_attention`, cached per CPU signature).
"""
from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqlab.accel import attention_amx
from seqlab.accel.calibrate import best_of_rounds, builds_per_dtype, describe_builds, dtype_name
from seqlab.accel.first_order import first_order_only
from seqlab.accel.prefill_attention import HEAD_DIM_MULTIPLE, SIMD, TILES, causal_attention, takes
from seqlab.accel.prefill_attention import SOURCE as FORWARD_SOURCE
from seqlab.accel.prefill_attention import library as forward_library
from seqlab.model.attention import SelfAttention
from seqlab.runtime import native

SOURCE = Path(__file__).with_name("attention_backward.c")
ROUNDS = 3
MAX_TIMED_TOKENS = 8192  # a step's batch x length timed at most (the kernel's cost per token does not grow with B)
i64 = ctypes.c_int64
_strides = i64 * 3


class _AttentionGrad(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_void_p) for name in ("q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv")),
                ("batch", i64), ("n_heads", i64), ("n_kv", i64), ("len", i64), ("head_dim", i64),
                *((f"{name}_strides", _strides) for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")),
                ("scale", ctypes.c_float)]


def library(isa: str) -> ctypes.CDLL | None:
    """The backward built for ``isa`` ("avx2" or "avx512"), or None where it cannot be built or run here."""
    return native.optional_library("attention_backward", SOURCE, isa, [SIMD, TILES], _signatures,
                                   "seqlab.accel: training attention kernel")


def _signatures(dll: ctypes.CDLL) -> None:
    dll.seqlab_causal_attention_backward.argtypes = [ctypes.POINTER(_AttentionGrad), ctypes.c_int]
    dll.seqlab_causal_attention_backward.restype = ctypes.c_int


def available_isas() -> list[str]:
    return [isa for isa in native.runnable_isas(library) if forward_library(isa) is not None]


def _heads_last(B: int, T: int, heads: int, D: int) -> Tensor:
    """An fp32 [B, heads, T, D] view of a [B, T, heads, D] tensor: the layout the model's projections give."""
    return torch.empty(B, T, heads, D, dtype=torch.float32, device="cpu").transpose(1, 2)


class _CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float, isa: str) -> Tensor:
        B, H, T, _ = q.shape
        lse = torch.empty(B, H, T, dtype=torch.float32, device="cpu")
        out = causal_attention(q, k, v, scale, isa, lse=lse)
        if out is None:
            raise RuntimeError("seqlab.accel: the training attention kernel could not allocate its scratch")
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.isa = scale, isa
        return out

    @staticmethod
    @first_order_only("training attention")  # no graph of its gradient: fail, not vanish
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        (B, H, T, D), G = q.shape, k.shape[1]
        dq, dk, dv = _heads_last(B, T, H, D), _heads_last(B, T, G, D), _heads_last(B, T, G, D)
        tensors = (q, k, v, out, dout, lse, dq, dk, dv)
        desc = _AttentionGrad(*(t.data_ptr() for t in tensors), B, H, G, T, D,
                              *(_strides(*t.stride()[:3]) for t in (q, k, v, out, dout, dq, dk, dv)), ctx.scale)
        if library(ctx.isa).seqlab_causal_attention_backward(ctypes.byref(desc), torch.get_num_threads()) != 0:
            raise RuntimeError("seqlab.accel: the training attention backward could not allocate its scratch")
        return dq, dk, dv, None, None


def trainable(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, enable_gqa: bool = False) -> bool:
    """Whether the kernel computes this SDPA call with its gradient (else SDPA does). fp32 and bf16 may mix (under
    autocast a rotary model's queries and keys come out fp32, its values bf16): the kernel widens them all."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return False
    if not any(t.requires_grad for t in (q, k, v)) or (k.dim() == 4 and k.shape[1] != q.shape[1] and not enable_gqa):
        return False
    return takes(q.detach(), k.detach(), v.detach(), attn_mask, dropout_p, is_causal,
                 mixed_dtypes=torch.is_autocast_enabled("cpu"))  # outside autocast SDPA refuses mixed dtypes


def causal_attention_trained(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, isa: str = "avx2",
                             out_dtype: torch.dtype | None = None) -> Tensor:
    """SDPA's ``is_causal`` result with autograd, on the kernels (the caller checked :func:`trainable`), in
    ``out_dtype`` (default: q's). bf16 inputs are widened once and computed in fp32, and the output rounded once
    (the prefill kernel's bf16 rule); their gradients come back in their own dtypes."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out_dtype = q.dtype if out_dtype is None else out_dtype
    out = _CausalAttention.apply(q.float(), k.float(), v.float(), scale, isa)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


class TrainAttention:
    """SDPA's signature; the calls :func:`trainable` takes run forward and backward on the build chosen for their
    dtype (``builds``: dtype -> "avx2", "avx512" or, for bf16, "amx" (``attention_amx``); a dtype not in it stays
    on SDPA)."""

    def __init__(self, builds: dict[torch.dtype, str]):
        self.builds = dict(builds)

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False) -> Tensor:
        # under autocast SDPA would compute in the autocast dtype: that is the dtype timed and the one returned
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
        isa = self.builds.get(dtype)
        if isa is not None and trainable(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
            if isa != attention_amx.ISA:
                return causal_attention_trained(query, key, value, scale, isa, dtype)
            if attention_amx.takes(query, key, value):
                return attention_amx.causal_attention_amx(query, key, value, scale)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    def __repr__(self) -> str:
        return describe_builds(self.builds)


def time_train_attention(n_heads: int, n_kv: int, head_dim: int, batch: int, length: int, dtype: torch.dtype,
                         candidates: dict[str, Callable[..., Tensor]],
                         clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Seconds per forward + backward of each candidate (SDPA's signature) on one layer's causal attention, best
    of interleaved rounds after a warm-up, on random inputs laid out as the model lays them out."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(batch, length, n_heads + 2 * n_kv, head_dim, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(batch, n_heads, length, head_dim, generator=g).to(dtype)

    def run(attend: Callable[..., Tensor]) -> Callable[[], None]:
        def one() -> None:
            q, k, v = (t.transpose(1, 2) for t in qkv.split((n_heads, n_kv, n_kv), dim=2))
            attend(q, k, v, is_causal=True, enable_gqa=n_heads != n_kv).backward(grad)
            qkv.grad = None
        return one

    return best_of_rounds({name: run(attend) for name, attend in candidates.items()}, ROUNDS, clock)


def choose_train_attention(model: nn.Module, batch: int, length: int,
                           dtypes: tuple[torch.dtype, ...] = (torch.float32,), use_cache: bool = True
                           ) -> tuple[TrainAttention | None, dict[str, float]]:
    """The kernel builds to put into ``model``'s self-attention for training ``batch`` x ``length`` tokens per
    step, per compute dtype in ``dtypes`` (None: SDPA is as fast for every one, or nothing fits), and the timings
    ("<dtype> <candidate>": seconds per layer's forward + backward; cached per CPU signature). A build must beat
    SDPA by ``calibrate.MIN_GAIN`` to be taken."""
    cfg = getattr(model, "config", None)
    if cfg is None or cfg.arch != "decoder" or cfg.attn_dropout or length < 2 or not any(
            isinstance(m, SelfAttention) for m in model.modules()):
        return None, {}
    isas = available_isas() if cfg.head_dim % HEAD_DIM_MULTIPLE == 0 else []
    if not isas:
        return None, {}
    amx = attention_amx.available() and length <= attention_amx.MAX_LEN
    batch = max(1, min(batch, MAX_TIMED_TOKENS // length))
    shape = f"{cfg.n_heads}x{cfg.n_kv_heads}x{cfg.head_dim}|B={batch}|T={length}"
    sources = native.source_key([SOURCE, FORWARD_SOURCE, SIMD, TILES, attention_amx.SOURCE, Path(__file__)])
    names = {dt: [*isas, attention_amx.ISA] if amx and dt == torch.bfloat16 else isas for dt in dtypes}
    builds, timings = builds_per_dtype(
        dtypes, lambda dt: f"train-attention|{shape}|{dtype_name(dt)}|{'+'.join(names[dt])}|{sources}",
        lambda dt: {isa: TrainAttention({dt: isa}) for isa in names[dt]},
        lambda dt, kernels: time_train_attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, batch, length, dt,
                                                 {"sdpa": F.scaled_dot_product_attention, **kernels}),
        "sdpa", use_cache)
    return (TrainAttention(builds) if builds else None), timings


def install(model: nn.Module, attend: TrainAttention) -> None:
    """Put ``attend`` into every self-attention of ``model`` (:func:`seqlab.accel.prefill_attention.uninstall`
    puts SDPA back)."""
    for m in model.modules():
        if isinstance(m, SelfAttention):
            m.attend = attend

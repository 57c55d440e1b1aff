"""Causal self-attention for bf16 training on AMX tiles (``attention_amx.c``), forward and backward.

Why: on a CPU with AMX a bf16 step's weight products run near a teraflop, and what is left is mostly vector
arithmetic; the training attention kernel (``attention_backward.c``) widens bf16 to fp32 and runs its products on
FMA units, about a quarter of a small model's step (docs/acceleration.md). Here every product is a tile product on
the bf16 operands (fp32 sums), and only the softmax and dS = P (dP - delta) are vector arithmetic. P and dS are
rounded to bf16 as operands of the next product, as flash attention does in bf16 on GPUs: the gradients agree with
fp32 arithmetic on the same bf16 inputs to about bf16 rounding, not to fp32 rounding as the widening kernel does
(tests/accel/test_attention_amx.py states the tolerances).

Whether it runs is decided as for the other training attention builds: timed against SDPA and those builds on the
model's own shape (``train_attention.choose_train_attention``), for bf16 compute only.
"""
from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch
from torch import Tensor

from seqlab.accel.first_order import first_order_only
from seqlab.runtime import native

SOURCE = Path(__file__).with_name("attention_amx.c")
SIMD = Path(__file__).with_name("simd.h")
ISA = "amx"
HEAD_DIM_MULTIPLE = 32  # one tile product's reduction
MAX_LEN = 2048  # the backward keeps a head's P and dS whole: 2 x len^2 bf16 per thread (16 MiB at 2048)
i64 = ctypes.c_int64
_strides = i64 * 3


class _Forward(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_void_p) for name in ("q", "k", "v", "out", "lse")),
                ("batch", i64), ("n_heads", i64), ("n_kv", i64), ("len", i64), ("head_dim", i64),
                *((f"{name}_strides", _strides) for name in ("q", "k", "v", "out")), ("scale", ctypes.c_float)]


class _Backward(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_void_p) for name in ("q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv")),
                ("batch", i64), ("n_heads", i64), ("n_kv", i64), ("len", i64), ("head_dim", i64),
                *((f"{name}_strides", _strides) for name in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")),
                ("scale", ctypes.c_float)]


def library() -> ctypes.CDLL | None:
    """The kernels, or None where this CPU (or an ISA cap, or the OS) gives no AMX to this process."""
    if native.isa_allowed(ISA) is not None:
        return None
    return _built()


def _built() -> ctypes.CDLL:
    """The library once :func:`library` found it (the per-call path: no CPU or environment lookups)."""
    return native.optional_library("attention_amx", SOURCE, ISA, [SIMD], _signatures)


def _signatures(dll: ctypes.CDLL) -> None:
    dll.seqlab_amx_enable.argtypes, dll.seqlab_amx_enable.restype = [], ctypes.c_int
    dll.seqlab_amx_attention.argtypes = [ctypes.POINTER(_Forward), ctypes.c_int]
    dll.seqlab_amx_attention.restype = ctypes.c_int
    dll.seqlab_amx_attention_backward.argtypes = [ctypes.POINTER(_Backward), ctypes.c_int]
    dll.seqlab_amx_attention_backward.restype = ctypes.c_int
    if dll.seqlab_amx_enable() != 0:  # the kernel asks Linux for the tile state (a kernel before 5.16 refuses);
        raise OSError("the OS did not grant this process AMX tile state")  # native: the build is then absent


def available() -> bool:
    return library() is not None


def takes(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Shapes the kernel computes: [B, H, T, D] queries over [B, G, T, D] keys and values, G dividing H, D a
    multiple of 32, T at most ``MAX_LEN``, the last dimension contiguous (and rows on 32-bit words: the kernel
    reads bf16 pairs as words)."""
    if not q.dim() == k.dim() == v.dim() == 4 or any(
            t.stride(-1) != 1 or t.device.type != "cpu" or t.data_ptr() % 4
            or any(s % 2 for s, n in zip(t.stride()[:3], t.shape[:3]) if n > 1) for t in (q, k, v)):
        return False
    (B, H, T, D), (Bk, G, Tk, Dk) = q.shape, k.shape
    return (0 < T <= MAX_LEN and G > 0 and (Bk, Tk, Dk) == (B, T, D) and tuple(v.shape) == (B, G, T, D)
            and H % G == 0 and D % HEAD_DIM_MULTIPLE == 0)


def _heads_last(B: int, T: int, heads: int, D: int) -> Tensor:
    """A bf16 [B, heads, T, D] view of a [B, T, heads, D] tensor: the layout the model's projections give."""
    return torch.empty(B, T, heads, D, dtype=torch.bfloat16).transpose(1, 2)


class _AmxCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        (B, H, T, D), G = q.shape, k.shape[1]
        out, lse = _heads_last(B, T, H, D), torch.empty(B, H, T, dtype=torch.float32)
        desc = _Forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), B, H, G, T, D,
                        *(_strides(*t.stride()[:3]) for t in (q, k, v, out)), scale)
        if _built().seqlab_amx_attention(ctypes.byref(desc), torch.get_num_threads()) != 0:
            raise RuntimeError("seqlab.accel: the AMX attention kernel could not allocate its scratch")
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    @first_order_only("AMX attention")  # no graph of its gradient: fail, not vanish
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.to(torch.bfloat16)
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        (B, H, T, D), G = q.shape, k.shape[1]
        dq, dk, dv = _heads_last(B, T, H, D), _heads_last(B, T, G, D), _heads_last(B, T, G, D)
        tensors = (q, k, v, out, dout, lse, dq, dk, dv)
        desc = _Backward(*(t.data_ptr() for t in tensors), B, H, G, T, D,
                         *(_strides(*t.stride()[:3]) for t in (q, k, v, out, dout, dq, dk, dv)), ctx.scale)
        if _built().seqlab_amx_attention_backward(ctypes.byref(desc), torch.get_num_threads()) != 0:
            raise RuntimeError("seqlab.accel: the AMX attention backward could not allocate its scratch")
        return dq, dk, dv, None


def causal_attention_amx(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """SDPA's ``is_causal`` result in bf16, with autograd (the caller checked :func:`takes`). Inputs in another
    dtype are rounded to bf16 first (their gradients come back in their own dtype)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v = (t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16) for t in (q, k, v))
    return _AmxCausalAttention.apply(q, k, v, scale)

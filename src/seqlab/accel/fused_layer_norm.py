"""A pre-norm block's LayerNorm for training, one C pass forward and one backward (``layer_norm.c``).

Why: under bf16 autocast the norm runs in fp32 (autocast's rule for ``layer_norm``) and the linear layer that reads
it rounds its output to bf16, so torch makes four passes over [tokens, d] (norm, cast; their two backwards) where
one pass each way does: the kernel writes the bf16 operand directly and takes its bf16 gradient. In a pre-norm block
(``cfg.pre_norm``) the attention's and the MLP's norms have no other reader, so that rounding is the one autocast
would do; the final norm and a post-norm model's norms (their outputs are the residual stream) are left as they are.
In fp32 the kernel is the same function in one pass each way. Agreement with ``F.layer_norm``: fp32 rounding
(tested). :func:`seqlab.accel.accelerate` installs it for training where a timed forward + backward beats torch's
(with the cast, under autocast), per compute dtype; :func:`uninstall` puts ``F.layer_norm`` back.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqlab.accel.calibrate import best_of_rounds, builds_per_dtype, describe_builds, dtype_name
from seqlab.accel.first_order import first_order_only
from seqlab.model.layers import LayerNorm
from seqlab.model.transformer import Block
from seqlab.runtime import native

SOURCE = Path(__file__).with_name("layer_norm.c")
SIMD = Path(__file__).with_name("simd.h")
MAX_TIMED_ROWS = 4096  # tokens of the timed probe (a step's whole batch, up to this)
ROUNDS = 5
_BF16 = {torch.float32: 0, torch.bfloat16: 1}


def library(isa: str) -> ctypes.CDLL | None:
    return native.optional_library("layer_norm", SOURCE, isa, [SIMD], _signatures)


def _signatures(dll: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    dll.seqlab_layer_norm_fwd.argtypes = [p, p, p, p, i32, p, p, i64, i64, f32, i32]
    dll.seqlab_layer_norm_bwd.argtypes = [p, i32, p, p, p, p, p, p, p, p, i64, i64, i32]
    dll.seqlab_layer_norm_fwd.restype = dll.seqlab_layer_norm_bwd.restype = None


def _vector_length(isa: str) -> int:
    return 16 if isa == "avx512" else 8


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, out_dtype: torch.dtype,
                isa: str) -> Tensor:
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        y = torch.empty(x2.shape, dtype=out_dtype)
        mean, rstd = (torch.empty(x2.shape[0], dtype=torch.float32) for _ in range(2))
        library(isa).seqlab_layer_norm_fwd(x2.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                           y.data_ptr(), _BF16[out_dtype], mean.data_ptr(), rstd.data_ptr(),
                                           x2.shape[0], n, eps, torch.get_num_threads())
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.isa, ctx.shape, ctx.out_dtype, ctx.has_bias = isa, x.shape, out_dtype, bias is not None
        return y.view(x.shape)

    @staticmethod
    @first_order_only("layer norm")  # no graph of its gradient: fail, not vanish
    def backward(ctx, dy: Tensor):
        x2, weight, mean, rstd = ctx.saved_tensors
        n, threads = x2.shape[1], torch.get_num_threads()
        dy = dy.to(ctx.out_dtype).reshape(x2.shape).contiguous()
        dx, dw = torch.empty_like(x2), torch.empty(n, dtype=torch.float32)
        db = torch.empty(n, dtype=torch.float32) if ctx.has_bias else None
        partial = torch.zeros(threads, 2 * n, dtype=torch.float32)
        library(ctx.isa).seqlab_layer_norm_bwd(dy.data_ptr(), _BF16[dy.dtype], x2.data_ptr(), weight.data_ptr(),
                                               mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(), dw.data_ptr(),
                                               0 if db is None else db.data_ptr(), partial.data_ptr(), x2.shape[0],
                                               n, threads)
        return dx.view(ctx.shape), dw, db, None, None, None


class FusedLayerNorm:
    """``F.layer_norm``'s signature; fp32 CPU calls over one trailing dimension run on the build chosen for their
    compute dtype (``builds``: fp32, or under autocast its dtype -> "avx2" or "avx512"), under autocast with the
    output in that dtype (the caller is a pre-norm block's norm, read only by a linear layer); the rest run
    ``F.layer_norm``."""

    def __init__(self, builds: dict[torch.dtype, str]):
        self.builds = dict(builds)

    def __call__(self, x: Tensor, normalized_shape, weight: Tensor | None = None, bias: Tensor | None = None,
                 eps: float = 1e-5) -> Tensor:
        autocast = torch.is_autocast_enabled("cpu")
        dtype = torch.get_autocast_dtype("cpu") if autocast else x.dtype
        isa = self.builds.get(dtype)
        if (isa is None or len(normalized_shape) != 1 or weight is None or x.device.type != "cpu"
                or x.dtype != torch.float32 or weight.dtype != torch.float32
                or (bias is not None and bias.dtype != torch.float32) or dtype not in _BF16
                or x.shape[-1] % _vector_length(isa) or torch.compiler.is_compiling()):
            return F.layer_norm(x, normalized_shape, weight, bias, eps)
        return _LayerNorm.apply(x, weight, bias, eps, dtype, isa)

    def __repr__(self) -> str:
        return describe_builds(self.builds)


def block_norms(model: nn.Module) -> list[LayerNorm]:
    """The LayerNorms whose only reader is a linear layer: a pre-norm block's attention, cross-attention and MLP
    norms."""
    cfg = getattr(model, "config", None)
    if cfg is None or cfg.norm != "layernorm" or not cfg.pre_norm:
        return []
    return [norm for block in model.modules() if isinstance(block, Block)
            for norm in (block.attn_norm, block.cross_norm, block.mlp_norm) if isinstance(norm, LayerNorm)]


def time_norms(rows: int, width: int, dtype: torch.dtype, candidates: dict[str, Callable[..., Tensor]],
               rounds: int = ROUNDS) -> dict[str, float]:
    """Seconds per forward + backward of each candidate (``F.layer_norm``'s signature) on fp32 [rows, width] input,
    under autocast to ``dtype`` where it is not fp32, the output cast to ``dtype`` (the linear layer's cast)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g).requires_grad_()
    w, b = (torch.randn(width, generator=g).requires_grad_() for _ in range(2))
    grad = torch.randn(rows, width, generator=g).to(dtype)

    def run(norm: Callable[..., Tensor]) -> Callable[[], None]:
        def one() -> None:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                y = norm(x, (width,), w, b, 1e-5).to(dtype)
            y.backward(grad)
            x.grad = w.grad = b.grad = None
        return one

    return best_of_rounds({name: run(norm) for name, norm in candidates.items()}, rounds)


def choose_layer_norm(model: nn.Module, rows: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,),
                      use_cache: bool = True) -> tuple[FusedLayerNorm | None, dict[str, float]]:
    """The builds to put into ``model``'s pre-norm block norms for training at ``rows`` tokens per step, per compute
    dtype (None: torch's is as fast for every one, or the model has no such norm), and the timings ("<dtype>
    <candidate>": seconds per forward + backward; cached per CPU signature)."""
    norms = block_norms(model)
    isas = [isa for isa in native.runnable_isas(library)
            if norms and norms[0].normalized_shape[0] % _vector_length(isa) == 0]
    if not isas:
        return None, {}
    width, rows = norms[0].normalized_shape[0], min(int(rows), MAX_TIMED_ROWS)
    builds, timings = builds_per_dtype(
        dtypes, lambda dt: f"layer_norm|train|{dtype_name(dt)}|rows={rows}|width={width}|"
                           f"{native.source_key([SOURCE, SIMD])}",
        lambda dt: {isa: FusedLayerNorm({dt: isa}) for isa in isas},
        lambda dt, kernels: time_norms(rows, width, dt, {"torch": F.layer_norm, **kernels}), "torch", use_cache)
    return (FusedLayerNorm(builds) if builds else None), timings


def install(model: nn.Module, norm: FusedLayerNorm) -> None:
    for m in block_norms(model):
        m.normalize = norm


def uninstall(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, LayerNorm):
            m.normalize = F.layer_norm

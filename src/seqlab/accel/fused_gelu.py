"""GPT-2's GELU (tanh approximation) for training, one C pass forward and one backward (``gelu.c``).

Why: profiled on a GPT-2-shaped training step (d 256, 4 layers, 2 threads), torch's ``gelu`` + ``gelu_backward``
took 36 ms of a 480 ms fp32 step under the AVX2 caps and 16 ms of a 180 ms bf16 step on AMX: about a layer's
attention. The function is the model's own (``F.gelu(x, approximate="tanh")``, to about 1e-6 relative);
:func:`seqlab.accel.accelerate` puts it into the MLPs of a model it accelerates for training where a timed forward
and backward beats torch's, and :func:`~seqlab.accel.restore_plain` puts torch's back.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from seqlab.accel.calibrate import best_of_rounds, builds_per_dtype, describe_builds, dtype_name
from seqlab.model.layers import MLP, activation_fn
from seqlab.runtime import native

SOURCE = Path(__file__).with_name("gelu.c")
SIMD = Path(__file__).with_name("simd.h")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_TIMED_ROWS = 4096  # tokens of the timed probe (a step's whole batch, up to this)


def library(isa: str) -> ctypes.CDLL | None:
    return native.optional_library("gelu", SOURCE, isa, [SIMD], _signatures)


def _signatures(dll: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    dll.seqlab_gelu_tanh_fwd.argtypes = [p, p, i64, i32, i32]
    dll.seqlab_gelu_tanh_bwd.argtypes = [p, p, p, i64, i32, i32]
    dll.seqlab_gelu_tanh_fwd.restype = dll.seqlab_gelu_tanh_bwd.restype = None


def _fits(x: Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _DTYPES


class _GeluTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, isa: str) -> Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        library(isa).seqlab_gelu_tanh_fwd(x.data_ptr(), y.data_ptr(), x.numel(), _DTYPES[x.dtype],
                                          torch.get_num_threads())
        ctx.save_for_backward(x)
        ctx.isa = isa
        return y

    @staticmethod
    def backward(ctx, gy: Tensor):
        (x,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # a graph of the gradient is wanted (a second derivative): torch's formula has one
            return torch.ops.aten.gelu_backward(gy.to(x.dtype), x, approximate="tanh"), None
        gy = gy.to(x.dtype).contiguous()
        gx = torch.empty_like(x)
        library(ctx.isa).seqlab_gelu_tanh_bwd(x.data_ptr(), gy.data_ptr(), gx.data_ptr(), x.numel(),
                                              _DTYPES[x.dtype], torch.get_num_threads())
        return gx, None


class FusedGeluTanh:
    """A drop-in for ``lambda x: F.gelu(x, approximate="tanh")`` (an MLP's ``act``), on the build chosen for the
    input's dtype (``builds``: dtype -> "avx2" or "avx512"; another dtype, or another device, runs torch's)."""

    def __init__(self, builds: dict[torch.dtype, str]):
        missing = [isa for isa in builds.values() if library(isa) is None]
        if missing:
            raise RuntimeError(f"the {missing[0]} GELU library is not available here")
        self.builds = dict(builds)

    def __call__(self, x: Tensor) -> Tensor:
        isa = self.builds.get(x.dtype)
        if isa is None or not _fits(x):
            return F.gelu(x, approximate="tanh")
        return _GeluTanh.apply(x, isa)

    def __repr__(self) -> str:
        return describe_builds(self.builds)


def time_gelus(rows: int, width: int, dtype: torch.dtype, candidates: dict, rounds: int = 5) -> dict[str, float]:
    """Seconds per forward + backward of each candidate ``act`` on a [rows, width] input, best of interleaved
    rounds (``candidates``: name -> callable; the plain one first)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(rows, width, generator=g).to(dtype)

    def run(act: Callable[[Tensor], Tensor]) -> Callable[[], None]:
        def one() -> None:
            act(x).backward(grad)
            x.grad = None
        return one

    return best_of_rounds({name: run(act) for name, act in candidates.items()}, rounds)


def gelu_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MLPs of ``model`` whose activation is the tanh GELU (the ones this function can stand in for)."""
    cfg = getattr(model, "config", None)
    if cfg is None or cfg.activation != "gelu_tanh":
        return []
    return [m for m in model.modules() if isinstance(m, MLP)]


def choose_gelu(model: torch.nn.Module, rows: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,),
                use_cache: bool = True) -> tuple[FusedGeluTanh | None, dict[str, float]]:
    """The fused GELU to put into ``model``'s MLPs for training at ``rows`` tokens per step, a build per dtype the
    activations may have (under bf16 autocast they are bf16; None: torch's is as fast for every one, or the model
    has no tanh-GELU MLP), and the timings ("<dtype> <candidate>"; cached per CPU signature)."""
    mlps = gelu_mlps(model)
    isas = native.runnable_isas(library)
    dtypes = tuple(dt for dt in dtypes if dt in _DTYPES)
    if not mlps or not isas or not dtypes:
        return None, {}
    width, rows = mlps[0].d_ff, min(int(rows), MAX_TIMED_ROWS)
    builds, timings = builds_per_dtype(
        dtypes, lambda dt: f"gelu_tanh|train|{dtype_name(dt)}|rows={rows}|width={width}|"
                           f"{native.source_key([SOURCE, SIMD])}",
        lambda dt: {isa: FusedGeluTanh({dt: isa}) for isa in isas},
        lambda dt, kernels: time_gelus(rows, width, dt, {"torch": activation_fn("gelu_tanh"), **kernels}),
        "torch", use_cache)
    return (FusedGeluTanh(builds) if builds else None), timings


def install(model: torch.nn.Module, act) -> None:
    for m in gelu_mlps(model):
        m.act = act


def uninstall(model: torch.nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, MLP) and isinstance(m.act, FusedGeluTanh):
            m.act = activation_fn("gelu_tanh")

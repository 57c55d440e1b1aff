"""The int4 / int8 weight-only product kernels (``kernel.c``), compiled with the machine's C compiler at first use.

The build (and its cache, keyed by the source and compiler flags) is :mod:`seqlab.runtime.native`'s. It targets
AVX2 + FMA, which both CPU families of the project have, plus an AVX-512 build where the CPU allows one. Where there
is no compiler, no AVX2 or the build fails, :func:`load_kernels` returns ``None`` (once, with a warning) and the
route chooser uses the torch routes only.
"""
from __future__ import annotations

import ctypes
import subprocess
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from seqlab.runtime import native
from seqlab.runtime.native import cache_dir, isa_allowed  # noqa: F401  (the route cache and tests use them here)

SOURCE = Path(__file__).with_name("kernel.c")
_STATE: dict[str, object] = {}


def _cpu_flags() -> set[str]:
    return native.cpu_flags()


def source_key(isa: str = "avx2") -> str:
    """Hash of the kernel source and flags: a new kernel build gets its own library and route decisions."""
    return native.source_key([SOURCE], isa)


def _build(isa: str) -> ctypes.CDLL:
    dll = native.build_library("quant", SOURCE, isa)
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    dll.seqlab_q4_gemm.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, i32]
    dll.seqlab_q8_gemm.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, i32]
    dll.seqlab_q4_dequant.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ptr, i32]
    dll.seqlab_q8_dequant.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, i32]
    dll.seqlab_flush.argtypes = [ptr, i64]
    for fn in (dll.seqlab_flush, dll.seqlab_q4_gemm, dll.seqlab_q8_gemm, dll.seqlab_q4_dequant, dll.seqlab_q8_dequant):
        fn.restype = None
    return dll


def load_kernels(isa: str = "avx2") -> ctypes.CDLL | None:
    """The compiled kernel library for ``isa``, or ``None`` where it cannot be built or run here.

    A failed AVX2 build is warned about once (the torch routes take over); a missing AVX-512 is not news."""
    if isa not in _STATE:
        try:
            _STATE[isa] = _build(isa)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            if isa == "avx2":
                warnings.warn(f"seqlab.quant: int kernels unavailable ({e}); using torch routes", RuntimeWarning)
            _STATE[isa] = None
    return _STATE[isa]  # type: ignore[return-value]


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def product(layer, isa: str = "avx2") -> Callable[[Tensor], Tensor]:
    """``x [M, K] -> x @ W.T (+ bias)`` for a quantised layer (fp32 ``x``, contiguous; see ``kernel.c``).

    Every address and size is taken once, here, so a decode step's call costs one C call and one allocation;
    the returned function holds the tensors it points into. It is stale once the layer's buffers are replaced.
    """
    dll = load_kernels(isa)
    if dll is None:
        raise RuntimeError(f"the {isa} int kernels are not available here")
    n, k = layer.out_features, layer.in_features
    group = layer.group_size or k
    q = layer.qweight
    scales = layer.scales.float().contiguous()  # a no-op unless someone cast the model (model.to(bf16))
    mins = None if layer.mins is None else layer.mins.float().contiguous()
    bias = None if layer.bias is None else layer.bias.float().contiguous()
    if layer.bits == 4:
        fn, weight_args = dll.seqlab_q4_gemm, (q.data_ptr(), scales.data_ptr(), mins.data_ptr())
    else:
        fn, weight_args = dll.seqlab_q8_gemm, (q.data_ptr(), scales.data_ptr())
    bias_ptr = _ptr(bias)
    empty, threads = torch.empty, torch.get_num_threads

    def run(x: Tensor) -> Tensor:
        m = x.shape[0]
        y = empty(m, n)
        fn(x.data_ptr(), m, k, *weight_args, n, group, bias_ptr, y.data_ptr(), threads())
        return y

    run.holds = (q, scales, mins, bias)  # type: ignore[attr-defined]
    return run


def dequantize_rows(layer, r0: int, r1: int) -> Tensor:
    """Rows ``[r0, r1)`` of a quantised layer's weight as fp32 ``[r1 - r0, K]`` (see ``kernel.c``)."""
    dll = load_kernels()
    k = layer.in_features
    out = torch.empty(r1 - r0, k, dtype=torch.float32)
    g = layer.group_size or k
    scales = layer.scales.float().contiguous()  # the C side reads fp32 (QuantLinear keeps them so; be sure)
    if layer.bits == 4:
        mins = layer.mins.float().contiguous()
        dll.seqlab_q4_dequant(_ptr(layer.qweight), _ptr(scales), _ptr(mins), k, g, r0, r1, _ptr(out),
                              torch.get_num_threads())
    else:
        dll.seqlab_q8_dequant(_ptr(layer.qweight), _ptr(scales), k, g, r0, r1, _ptr(out), torch.get_num_threads())
    return out


def evict(*tensors: Tensor | None) -> None:
    """Flush these tensors' bytes from the CPU caches (no-op without the kernel library)."""
    dll = load_kernels()
    if dll is not None:
        for t in tensors:
            if t is not None and t.numel():
                dll.seqlab_flush(_ptr(t), t.numel() * t.element_size())

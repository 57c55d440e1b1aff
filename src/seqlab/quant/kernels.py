"""The int4 / int8 weight-only product kernels (``kernel.c``), compiled with the machine's C compiler at first use.

Why C through ``ctypes`` rather than a torch C++ extension: the file needs no torch headers and no ninja, so it
builds in about a second with plain ``gcc`` on a clean machine. The library is cached under
``$SEQLAB_CACHE`` (default ``~/.cache/seqlab``) keyed by the source and compiler flags. It targets AVX2 + FMA,
which both CPU families of the project have. Where there is no compiler, no AVX2 or the build fails,
:func:`load_kernels` returns ``None`` (once, with a warning) and the route chooser uses the torch routes only.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import torch
from torch import Tensor

from seqlab.runtime.files import atomic_path

_SOURCE = Path(__file__).with_name("kernel.c")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_STATE: dict[str, object] = {}


def _cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def cache_dir() -> Path:
    return Path(os.environ.get("SEQLAB_CACHE", Path.home() / ".cache" / "seqlab"))


def source_key() -> str:
    """Hash of the kernel source and flags: a new kernel build gets its own library and route decisions."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or "cc"
    return hashlib.sha256(_SOURCE.read_bytes() + " ".join([cc, *_FLAGS]).encode()).hexdigest()[:16]


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    if not _cpu_has_avx2():
        raise RuntimeError("the CPU has no AVX2 + FMA")
    lib = cache_dir() / "kernels" / f"quant_{source_key()}.so"
    if not lib.is_file():
        with atomic_path(lib) as tmp:  # processes that build at once each rename a whole library into place
            proc = subprocess.run([cc, *_FLAGS, "-o", str(tmp), str(_SOURCE)], capture_output=True, text=True,
                                  timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:500]}")
    dll = ctypes.CDLL(str(lib))
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    dll.seqlab_q4_gemm.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, i32]
    dll.seqlab_q8_gemm.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, i32]
    dll.seqlab_q4_dequant.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ptr, i32]
    dll.seqlab_q8_dequant.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, i32]
    dll.seqlab_flush.argtypes = [ptr, i64]
    for fn in (dll.seqlab_flush, dll.seqlab_q4_gemm, dll.seqlab_q8_gemm, dll.seqlab_q4_dequant, dll.seqlab_q8_dequant):
        fn.restype = None
    return dll


def load_kernels() -> ctypes.CDLL | None:
    """The compiled kernel library, or ``None`` where it cannot be built here (the reason is warned once)."""
    if "dll" not in _STATE:
        try:
            _STATE["dll"] = _build()
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            warnings.warn(f"seqlab.quant: int kernels unavailable ({e}); using torch routes", RuntimeWarning)
            _STATE["dll"] = None
    return _STATE["dll"]  # type: ignore[return-value]


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def int4_matmul(x: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor, group_size: int,
                bias: Tensor | None = None) -> Tensor:
    """``x [M, K] @ W.T (+ bias)`` for a packed int4 ``W`` (fp32 ``x`` contiguous; see ``kernel.c``)."""
    dll = load_kernels()
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    dll.seqlab_q4_gemm(_ptr(x), m, k, _ptr(qweight), _ptr(scales), _ptr(mins), n, group_size, _ptr(bias), _ptr(y),
                       torch.get_num_threads())
    return y


def int8_matmul(x: Tensor, qweight: Tensor, scales: Tensor, group_size: int, bias: Tensor | None = None) -> Tensor:
    """``x [M, K] @ W.T (+ bias)`` for an int8 ``W`` with a scale per row and group (``group_size`` 0 = row)."""
    dll = load_kernels()
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    dll.seqlab_q8_gemm(_ptr(x), m, k, _ptr(qweight), _ptr(scales), n, group_size or k, _ptr(bias), _ptr(y),
                       torch.get_num_threads())
    return y


def dequantize_rows(layer, r0: int, r1: int) -> Tensor:
    """Rows ``[r0, r1)`` of a quantised layer's weight as fp32 ``[r1 - r0, K]`` (see ``kernel.c``)."""
    dll = load_kernels()
    k = layer.in_features
    out = torch.empty(r1 - r0, k, dtype=torch.float32)
    g = layer.group_size or k
    if layer.bits == 4:
        dll.seqlab_q4_dequant(_ptr(layer.qweight), _ptr(layer.scales), _ptr(layer.mins), k, g, r0, r1, _ptr(out),
                              torch.get_num_threads())
    else:
        dll.seqlab_q8_dequant(_ptr(layer.qweight), _ptr(layer.scales), k, g, r0, r1, _ptr(out),
                              torch.get_num_threads())
    return out


def evict(*tensors: Tensor | None) -> None:
    """Flush these tensors' bytes from the CPU caches (no-op without the kernel library)."""
    dll = load_kernels()
    if dll is not None:
        for t in tensors:
            if t is not None and t.numel():
                dll.seqlab_flush(_ptr(t), t.numel() * t.element_size())

"""What this CPU and this torch build can do, as seen from inside the process (ISA caps included).

Why: the calibration cache is only valid for the machine, torch build and ISA limits that measured it, and the
bf16 routes are only worth timing where bf16 dot products are native. ``ONEDNN_MAX_CPU_ISA``,
``MKL_ENABLE_INSTRUCTIONS`` and ``ATEN_CPU_CAPABILITY`` can make an AVX-512/AMX machine behave like an AVX2 one,
so they are part of the signature.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import lru_cache

import torch

# flags that change which kernels oneDNN/MKL/ATen may run; the rest of /proc/cpuinfo's flags do not matter here
_ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
              "amx_tile", "amx_bf16", "amx_int8", "avx_vnni", "asimd", "sve", "bf16")
_CAP_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
# what makes torch, oneDNN and MKL on an AVX-512/AMX machine run as on an AVX2-only CPU (read when torch loads)
AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
# oneDNN ISA names at or above which bf16 dot products are native (lower caps emulate bf16)
_ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX",
                     "AVX10_1_512_AMX_FP16", "AVX10_2_512_AMX_2", "ALL", "DEFAULT")


@dataclass(frozen=True)
class CpuSignature:
    """Everything a measured route choice depends on besides the product shape."""

    cpu_model: str
    flags: tuple[str, ...]
    caps: tuple[tuple[str, str], ...]  # the ISA-limiting environment variables that are set
    torch_version: str
    aten_capability: str
    threads: int

    def key(self) -> str:
        """A short stable hash: the calibration cache file name."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict:
        return json.loads(json.dumps(asdict(self)))


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.processor() or platform.machine()):
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def current_signature() -> CpuSignature:
    model, flags = _cpuinfo()
    caps = tuple((v, os.environ[v]) for v in _CAP_VARS if os.environ.get(v))
    return CpuSignature(cpu_model=model, flags=tuple(f for f in _ISA_FLAGS if f in flags), caps=caps,
                        torch_version=torch.__version__, aten_capability=torch.backends.cpu.get_cpu_capability(),
                        threads=torch.get_num_threads())


def native_bf16(sig: CpuSignature | None = None) -> bool:
    """True when bf16 products run on native instructions (AMX-BF16 or AVX512-BF16) and no ISA cap hides them."""
    sig = sig or current_signature()
    if not {"amx_bf16", "avx512_bf16"} & set(sig.flags):
        return False
    caps = dict(sig.caps)
    onednn = (caps.get("ONEDNN_MAX_CPU_ISA") or caps.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    return onednn in _ONEDNN_BF16_ISAS


def isa_above_avx2(sig: CpuSignature | None = None) -> bool:
    """True when the CPU has AVX-512 (or AMX): then the test suite also runs under the AVX2 caps."""
    sig = sig or current_signature()
    return bool({"avx512f", "amx_tile"} & set(sig.flags))


_ISA_TAG_PREFIX = "seqlab-isa="


def key_compile_caches_by_isa() -> str:
    """Add this process's ISA signature to ``torch.compile``'s cache key; return the tag (process-wide, idempotent).

    Why: Inductor's FX graph cache (torch 2.13) stores the C++ source it generates, keyed by graph and settings but
    not by the vector ISA it was generated for; the cached source is then compiled with this process's ISA flags. A
    graph cached by a native AVX-512 run and reused under ``ATEN_CPU_CAPABILITY=avx2`` steps its loops 16 floats at
    a time over 8-float vectors and returns garbage (seqlab's compiled decode step: every token 0); the other way
    round it corrupts the heap. Same CPU model, flags, caps and capability: same tag, so the cache still hits. Any
    other parts of the tag (a user's own) stay.
    """
    sig = current_signature()
    isa = json.dumps([sig.cpu_model, sig.flags, sig.caps, sig.aten_capability, sig.torch_version])
    tag = _ISA_TAG_PREFIX + hashlib.sha256(isa.encode()).hexdigest()[:16]
    config = torch.compiler.config
    kept = [part for part in config.cache_key_tag.split("|") if part and not part.startswith(_ISA_TAG_PREFIX)]
    config.cache_key_tag = "|".join([*kept, tag])
    return tag


def compile_keyed_by_isa(fn: Callable, **compile_kwargs) -> Callable:
    """``torch.compile(fn, **compile_kwargs)`` with the on-disk caches keyed by this process's ISA (see above)."""
    key_compile_caches_by_isa()
    return torch.compile(fn, **compile_kwargs)

"""seqlab's own small C libraries: compiled with the machine's C compiler at first use, loaded with ``ctypes``.

Why C through ``ctypes`` rather than a torch C++ extension: the sources need no torch headers and no ninja, so they
build in about a second with plain ``gcc`` on a clean machine. A library is cached under
``runtime.files.cache_root()`` (``$SEQLAB_CACHE``, default ``~/.cache/seqlab``) by a hash of its sources and flags,
so a changed source or compiler gets its own build.
Each source can be built for AVX2 + FMA (both CPU families of the project have it) and, where the CPU has it and no
ISA cap hides it, for AVX-512; which build runs is decided by timing, by the caller.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from seqlab.runtime.cpu import current_signature
from seqlab.runtime.files import atomic_path, cache_root

BASE_FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
ISA_FLAGS = {"avx2": (), "avx512": ("-mavx512f", "-mavx512bw"),
             "amx": ("-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16")}
VECTOR_ISAS = ("avx2", "avx512")  # the builds of the vector kernels; "amx" is the tile kernels' own
_ISA_CPU_FLAGS = {"avx2": ("avx2", "fma"), "avx512": ("avx2", "fma", "avx512f", "avx512bw"),
                  "amx": ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")}
# an ISA cap (as on an AVX2-only machine, or set by a user) keeps the wider build out
_CAPS_BELOW_512 = {"ATEN_CPU_CAPABILITY": ("default", "avx2"), "ONEDNN_MAX_CPU_ISA": ("SSE41", "AVX", "AVX2"),
                   "DNNL_MAX_CPU_ISA": ("SSE41", "AVX", "AVX2"), "MKL_ENABLE_INSTRUCTIONS": ("SSE4_2", "AVX", "AVX2")}


def cpu_flags() -> set[str]:
    return set(current_signature().flags)  # the ISA flags runtime.cpu reads once from /proc/cpuinfo


def isa_allowed(isa: str) -> str | None:
    """None when this CPU may run the ``isa`` build, else the reason it may not."""
    missing = [f for f in _ISA_CPU_FLAGS[isa] if f not in cpu_flags()]
    if missing:
        return f"the CPU has no {' + '.join(missing)}"
    if isa in ("avx512", "amx"):
        for var, below in _CAPS_BELOW_512.items():
            if os.environ.get(var, "").upper() in {b.upper() for b in below}:
                return f"{var}={os.environ[var]} caps the ISA below AVX-512"
    if isa == "amx":  # oneDNN's own limit below AMX keeps the tile kernels out too
        for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
            cap = os.environ.get(var, "").upper()
            if cap and "AMX" not in cap and cap not in ("ALL", "DEFAULT"):
                return f"{var}={os.environ[var]} caps the ISA below AMX"
    return None


def cache_dir() -> Path:
    return cache_root()


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _flags(isa: str, include: Sequence[Path]) -> list[str]:
    return [*BASE_FLAGS, *ISA_FLAGS[isa], *(f"-I{d}" for d in include)]


def source_key(sources: Sequence[Path], isa: str = "avx2") -> str:
    """Hash of the sources (a main file and what it includes) and flags: a new build gets its own library."""
    blob = b"".join(p.read_bytes() for p in sources) + " ".join([compiler() or "cc", *_flags(isa, [])]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def build_library(name: str, source: Path, isa: str = "avx2", includes: Sequence[Path] = ()) -> ctypes.CDLL:
    """Compile ``source`` for ``isa`` once per source hash and load it; ``includes`` are the files it
    ``#include``s (hashed too; their folders go on the include path). Raises RuntimeError with the reason where
    it cannot be built here."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    reason = isa_allowed(isa)
    if reason:
        raise RuntimeError(reason)
    lib = cache_dir() / "kernels" / f"{name}_{isa}_{source_key([source, *includes], isa)}.so"
    if not lib.is_file():
        with atomic_path(lib) as tmp:  # processes that build at once each rename a whole library into place
            cmd = [cc, *_flags(isa, sorted({p.parent for p in includes})), "-o", str(tmp), str(source), "-lm"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:500]}")
    return ctypes.CDLL(str(lib))


_OPTIONAL: dict[tuple[str, str], ctypes.CDLL | None] = {}


def optional_library(name: str, source: Path, isa: str, includes: Sequence[Path] = (),
                     signatures: Callable[[ctypes.CDLL], None] = lambda dll: None,
                     feature: str | None = None) -> ctypes.CDLL | None:
    """:func:`build_library` once per process, or None where it cannot be built or run here (the caller then runs
    torch's ops). ``signatures`` sets a fresh library's argtypes; ``feature`` names it in a warning when the AVX2
    build, the one every supported CPU runs, fails (a missing wider build is ordinary)."""
    if (name, isa) not in _OPTIONAL:
        try:
            dll = build_library(name, source, isa, includes)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            if feature is not None and isa == "avx2":
                warnings.warn(f"{feature} unavailable ({e})", RuntimeWarning)
            dll = None
        if dll is not None:
            try:
                signatures(dll)
            except OSError as e:  # built, but this process may not run it (an OS that refuses AMX tile state)
                warnings.warn(f"{feature or name} ({isa}) unavailable: {e}", RuntimeWarning)
                dll = None
        _OPTIONAL[(name, isa)] = dll
    return _OPTIONAL[(name, isa)]


def runnable_isas(library: Callable[[str], object]) -> list[str]:
    """The vector builds (``"avx2"``, ``"avx512"``) this CPU may run, under the ISA caps in force, that ``library``
    has."""
    return [isa for isa in VECTOR_ISAS if isa_allowed(isa) is None and library(isa) is not None]

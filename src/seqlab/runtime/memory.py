"""Give freed heap memory back to the operating system.

Why: glibc's allocator keeps memory that was freed in the middle of its heap, so a process whose working set
peaked once (a burst of requests of many shapes) keeps that resident set afterwards. A long-running server calls
:func:`trim_heap` when it falls idle, so its RSS follows its load instead of its history. Elsewhere (another libc,
another OS) this is a no-op. :func:`map_large_blocks` keeps large transient buffers out of the heap altogether.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache


@lru_cache(maxsize=None)
def _libc(name: str, argtypes: tuple, restype):
    """The C library's function ``name`` with its signature set, or None where there is no such function."""
    lib = ctypes.util.find_library("c")
    try:
        fn = getattr(ctypes.CDLL(lib), name) if lib else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = list(argtypes), restype
    return fn


def _malloc_trim():
    return _libc("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)


def trim_heap() -> bool:
    """Return free heap pages to the OS; True if the allocator released something."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


# glibc's mallopt parameter number for the mmap threshold (malloc.h: M_MMAP_THRESHOLD)
_M_MMAP_THRESHOLD = -3


def map_large_blocks(threshold_bytes: int = 1 << 20) -> bool:
    """Serve every allocation of ``threshold_bytes`` or more by its own mapping, returned to the OS when freed.

    Why: glibc raises its mmap threshold each time a large mapped block is freed, after which large transient
    buffers (a step's logits, oneDNN's scratch space) come from the heap and leave holes that ``malloc_trim``
    cannot return. A server that steps thousands of batches of changing shapes then grows without leaking
    (docs/serving.md has the measurement). Fixing the threshold also turns that adjustment off. Process-wide; a
    no-op (False) where the C library has no ``mallopt``.
    """
    fn = _libc("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    return bool(fn(_M_MMAP_THRESHOLD, int(threshold_bytes))) if fn is not None else False

"""Give freed heap memory back to the operating system.

Why: glibc's allocator keeps memory that was freed in the middle of its heap, so a process whose working set
peaked once (a burst of requests of many shapes) keeps that resident set afterwards. A long-running server calls
:func:`trim_heap` when it falls idle, so its RSS follows its load instead of its history. Elsewhere (another libc,
another OS) this is a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache


@lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim_heap() -> bool:
    """Return free heap pages to the OS; True if the allocator released something."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False

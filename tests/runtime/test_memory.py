"""trim_heap gives freed heap pages back where the C library can (glibc), and is a harmless no-op elsewhere."""
from __future__ import annotations

import platform

from seqlab.runtime.memory import _malloc_trim, trim_heap


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def test_trim_heap_returns_freed_pages_on_glibc():
    if platform.libc_ver()[0] != "glibc":  # elsewhere the contract is only: no error, nothing released
        assert trim_heap() is False
        return
    assert _malloc_trim() is not None
    # small blocks live in the heap (not mmap): fill ~64 MiB, keep every 64th so the heap cannot simply shrink
    blocks = [bytearray(16 << 10) for _ in range(4096)]
    keep = blocks[::64]
    del blocks
    before = _rss_anon_kib()
    trim_heap()
    assert _rss_anon_kib() < before - (16 << 10)  # at least 16 MiB of the freed ~63 MiB went back
    assert keep  # the survivors are still there

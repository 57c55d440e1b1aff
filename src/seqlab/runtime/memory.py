"""Process memory: give freed heap back to the OS, keep large blocks out of it, huge pages, reused scratch.

Why: glibc's allocator keeps memory that was freed in the middle of its heap, so a process whose working set
peaked once (a burst of requests of many shapes) keeps that resident set afterwards. A long-running server calls
:func:`trim_heap` when it falls idle, so its RSS follows its load instead of its history. Elsewhere (another libc,
another OS) this is a no-op. :func:`map_large_blocks` keeps large transient buffers out of the heap altogether,
:func:`keep_freed_blocks` does the opposite for a training process (the next step reuses the last step's
pages), :class:`TrimOnGrowth` bounds what that kept heap may grow to when the sizes drift from step to step,
:func:`move_to_huge_pages` puts long-lived weights on 2 MiB pages, :func:`zeros_on_demand` makes a worst-case
buffer resident only where it is used, and :class:`ScratchPool` hands a training step's largest tensors back to the
next step instead of faulting in fresh pages.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
from dataclasses import dataclass
from functools import lru_cache

import torch


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
    return _mallopt(_M_MMAP_THRESHOLD, threshold_bytes)


def _mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt(param, value)``; False where it refused or the C library has none."""
    fn = _libc("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    return bool(fn(param, int(value))) if fn is not None else False


_M_TRIM_THRESHOLD = -1


def status_kib(field: str) -> int | None:
    """A ``/proc/self/status`` memory field in KiB (``VmRSS``: resident now; ``VmHWM``: its peak); None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def keep_freed_blocks(threshold_bytes: int = 1 << 30) -> bool:
    """Serve allocations below ``threshold_bytes`` from the heap and keep freed memory there for the next one.

    Why: a training step allocates and frees the same large tensors every step (a GPT-2-shaped step's logits and
    their gradient are 64 MiB each). glibc maps a block above its mmap threshold (32 MiB at most) afresh each time,
    and trims the heap top once more than twice the threshold is free, so the kernel faults those pages in again
    on every step: ~85 MiB a step for seqlab's fp32 step, 270 MiB for HF's (measured with getrusage). Raising
    both thresholds makes each step reuse the last step's pages once the heap has settled (within six steps in
    40 runs, by address layout: torch's aligned blocks must line up with the free chunks), which is what
    tcmalloc or jemalloc give CPU training runs. The resident set then stays at the step's peak (plus what the
    first steps took off the heap top), which a training process holds anyway. The opposite of
    :func:`map_large_blocks` (a server of changing shapes); process-wide; False where the C library has no
    ``mallopt``.
    """
    return _mallopt(_M_MMAP_THRESHOLD, threshold_bytes) and _mallopt(_M_TRIM_THRESHOLD, threshold_bytes)


@dataclass
class TrimOnGrowth:
    """Return the heap's free pages once the resident set has outgrown a step's working set by a margin.

    Why: under :func:`keep_freed_blocks` the heap keeps every page a step frees, for the next step to reuse. When
    the sizes drift from step to step (an NNQS selected space that grows), the freed blocks stop fitting and the
    heap spans ever more pages, all resident but free. A trim gives them back and the next step faults in only
    what it touches; trimming on growth, not after every step, keeps that cost off runs whose footprint is steady
    (docs/nnqs.md, "The memory grows", has the measurements).
    """

    margin: float = 0.1  # growth over the working set, as a fraction of it, that triggers a trim ...
    min_kib: int = 256 << 10  # ... and at least this much
    working_set_kib: int | None = None  # the resident set after the first step since the last trim

    def trim(self) -> None:
        """Give the free pages back now (before the first step: what setup freed); the next step's resident set
        becomes the working set."""
        trim_heap()
        self.working_set_kib = None

    def after_step(self, resident_kib: int | None) -> bool:
        """Called with the resident set after each step; True when it trimmed."""
        if resident_kib is None:
            return False
        if self.working_set_kib is None:
            self.working_set_kib = resident_kib
            return False
        if resident_kib - self.working_set_kib <= max(self.margin * self.working_set_kib, self.min_kib):
            return False
        self.trim()
        return True


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_available() -> bool:
    """True where the kernel backs ``madvise(MADV_HUGEPAGE)`` regions with transparent huge pages."""
    try:
        mode = open(_THP_MODE, encoding="ascii").read()
    except OSError:
        return False
    return "[never]" not in mode and _libc("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int),
                                           ctypes.c_int) is not None


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """A zeroed uint8 tensor of at least ``nbytes`` on an anonymous mapping advised for 2 MiB pages (None where
    the kernel or C library cannot). The mapping lives as long as a tensor viewing it does."""
    if not huge_pages_available():
        return None
    size = -(-max(nbytes, 1) // _HUGE_PAGE) * _HUGE_PAGE
    region = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds ``region`` alive
    start = -whole.data_ptr() % _HUGE_PAGE
    if _libc("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)(
            whole.data_ptr() + start, size, _MADV_HUGEPAGE) != 0:
        return None
    return whole[start:start + size]


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None
                    ) -> torch.Tensor:
    """Zeros whose pages the OS supplies on first touch, so that untouched parts cost no memory.

    Why: ``torch.zeros`` writes every byte, so a buffer sized for the worst case (a server's KV slots, every
    request at full context) is resident in full from the start. An anonymous mapping reads as zeros and is
    resident only where touched. CPU tensors of at least a page; anything else is ``torch.zeros``.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device or "cpu").type != "cpu" or nbytes < mmap.PAGESIZE:
        return torch.zeros(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)  # holds ``region`` alive


def move_to_huge_pages(tensors: list[torch.Tensor], align: int = 64) -> int:
    """Move the data of ``tensors`` (in place: each keeps its identity, ``.data`` points to the new memory) into
    one region of 2 MiB pages; return the bytes moved (0 where huge pages are not available).

    Why: a decode step streams every weight from memory once per token. With 4 KiB pages a 0.5 GB model spans
    130 000 pages, and the page walks of the hardware and software prefetchers cost a quarter of a batch-1 step
    (measured: SmolLM2-135M's fused fp32 step 26 ms on 4 KiB pages, 20 ms on 2 MiB ones; the 4 KiB figure also
    varied by 25 % from one process to the next). Only tensors that own their whole storage are moved, so views
    and tied tensors that share one storage keep sharing it.
    """
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in {id(t): t for t in tensors}.values():
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    movable = [group[0] for group in by_storage.values() if len(group) == 1 and group[0].is_contiguous()
               and group[0].storage_offset() == 0 and group[0].device.type == "cpu"
               and group[0].untyped_storage().nbytes() == group[0].numel() * group[0].element_size()]
    sizes = [-(-t.numel() * t.element_size() // align) * align for t in movable]
    arena = huge_page_buffer(sum(sizes)) if movable else None
    if arena is None:
        return 0
    offset = 0
    with torch.no_grad():
        for t, size in zip(movable, sizes):
            nbytes = t.numel() * t.element_size()
            view = arena[offset:offset + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            t.data = view  # the old storage is freed here, one tensor at a time (peak: the model + one tensor)
            offset += size
    return offset


def _storage_refs(t: torch.Tensor) -> int:
    """References to ``t``'s storage, less the one ``untyped_storage()`` itself adds while this reads it."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


class ScratchPool:
    """Large step-sized CPU tensors handed out again once nobody but the pool holds them.

    Why: glibc maps every block above its mmap threshold (32 MiB at most) afresh and the kernel faults its pages in
    on first touch, on every call: filling a fresh 2048 x 8192 fp32 tensor (64 MiB) costs ~12 ms on 2 cores here,
    a reused one ~1.5 ms. A training step builds the same large tensors (the loss's softmax) every step, so the
    pool keeps one per dtype and gives it back while nothing else uses its storage. The pool's own tensor never
    leaves it: callers get an alias over the same storage, so any holder (the alias, a view of it, autograd's saved
    copy of it) counts against the storage, and a tensor still held is never handed out twice (a new one is made).
    A different shape replaces the kept tensor, so batches of changing lengths never pile up buffers.
    """

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype``, reused where it is free."""
        buf = self._buffers.get(dtype)
        if buf is None or buf.shape != tuple(shape) or _storage_refs(buf) > 1:
            buf = self._buffers[dtype] = torch.empty(shape, dtype=dtype)
        return buf.detach()  # an alias: what the caller holds is visible in the storage's count

    def clear(self) -> None:
        """Drop the pool's references (memory is freed once the last other holder lets go)."""
        self._buffers.clear()

"""trim_heap and map_large_blocks give freed memory back where the C library can (glibc); no-ops elsewhere.
move_to_huge_pages puts weights on 2 MiB pages where the kernel has transparent huge pages."""
from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seqlab.runtime import memory
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


# In a fresh interpreter: free one 8 MiB block (glibc then raises its mmap threshold above 8 MiB), then fill and
# free another and report how much of it stayed resident.
_RETAINED = """
import sys
from seqlab.runtime.memory import map_large_blocks
if sys.argv[1] == "fixed":
    assert map_large_blocks(1 << 20)
def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
def filled(n):
    block = bytearray(n)
    for i in range(0, n, 4096):
        block[i] = 1
    return block
first = filled(8 << 20); del first
before = anon()
block = filled(8 << 20)
pin = bytearray(4096)  # allocated after the block: a heap block below it cannot be trimmed off the top
del block
print(anon() - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the mmap threshold is glibc's")
def test_map_large_blocks_returns_large_freed_blocks_at_once():
    def retained_kib(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _RETAINED, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    assert retained_kib("dynamic") > 6 << 10  # glibc's default: the second block came from the heap and stayed
    assert retained_kib("fixed") < 1 << 10  # fixed threshold: it was its own mapping, unmapped when freed


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


@pytest.mark.skipif(not memory.huge_pages_available(), reason="the kernel has transparent huge pages off")
def test_weights_move_onto_huge_pages_keeping_identity_values_and_ties():
    weight = torch.nn.Parameter(torch.randn(1024, 1024))  # 4 MiB
    small = torch.arange(10)
    shared = torch.randn(64, 64)
    alias = shared[:8]  # two tensors over one storage: moving one would break the aliasing
    expected = weight.detach().clone()
    before = _anon_huge_kib()
    moved = memory.move_to_huge_pages([weight, small, weight, shared, alias])
    assert moved >= weight.numel() * 4 + small.numel() * 8
    assert torch.equal(weight.detach(), expected) and torch.equal(small, torch.arange(10))
    assert weight.data_ptr() % (2 << 20) == 0 and isinstance(weight, torch.nn.Parameter)
    alias[0, 0] = 123.0
    assert shared[0, 0] == 123.0  # not moved: still one storage
    assert _anon_huge_kib() - before >= 2 << 10  # at least one 2 MiB page backs the weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_on_demand_are_zeros_resident_only_where_touched(dtype):
    before = _rss_anon_kib()
    t = memory.zeros_on_demand((64, 1024, 1024), dtype)  # 128-256 MiB
    assert t.shape == (64, 1024, 1024) and t.dtype == dtype and t.is_contiguous()
    assert _rss_anon_kib() - before < 16 << 10  # torch.zeros would make all of it resident now
    t[3, :8] = 1.5  # writable; the touched pages (32 KiB) become resident, nothing else
    assert _rss_anon_kib() - before < 16 << 10
    assert t[3, :8].eq(1.5).all() and t[:3].count_nonzero() == 0 and t[3, 8:].count_nonzero() == 0
    small = memory.zeros_on_demand((3, 5), dtype)  # under a page: plain zeros
    assert torch.equal(small, torch.zeros(3, 5, dtype=dtype))


def test_no_huge_pages_means_nothing_moves(monkeypatch):
    monkeypatch.setattr(memory, "huge_pages_available", lambda: False)
    t = torch.randn(100)
    ptr = t.data_ptr()
    assert memory.move_to_huge_pages([t]) == 0 and t.data_ptr() == ptr


def test_scratch_pool_reuses_free_tensors_and_never_hands_out_a_held_one():
    pool = memory.ScratchPool()
    a = pool.take((64, 32), torch.float32)
    ptr = a.data_ptr()
    del a
    b = pool.take((64, 32), torch.float32)
    assert b.data_ptr() == ptr  # free again: the same storage
    c = pool.take((64, 32), torch.float32)  # ``b`` is still held here
    assert c.data_ptr() != b.data_ptr()
    for alias in (lambda t: t[:4], lambda t: t.detach(), lambda t: t.view(-1)):  # views and aliases count too
        kept = alias(pool.take((16, 8), torch.float32))
        assert pool.take((16, 8), torch.float32).data_ptr() != kept.data_ptr()
    assert pool.take((64, 32), torch.bfloat16).dtype == torch.bfloat16  # keyed by dtype
    d = pool.take((32, 32), torch.float32)
    assert d.shape == (32, 32)  # another shape replaces the kept tensor
    del d
    assert len(pool._buffers) == 2
    pool.clear()
    assert not pool._buffers


_STEP_FAULTS = """
import resource, sys
import torch
from seqlab.runtime.memory import keep_freed_blocks
if sys.argv[1] == "keep":
    assert keep_freed_blocks()
x = torch.randn(1024, 16384)  # 64 MiB, a GPT-2-shaped step's logits
# A step that makes and frees a tensor of that size, warmed up. Under "keep" the heap settles within a few steps:
# torch asks for 64-byte-aligned blocks, and until the free chunks line up with that alignment a step may take
# fresh pages off the heap top (in 40 runs the last such step was the 1st, 3rd or 6th, by address layout).
for _ in range(8):
    torch.exp(x)
steps = []
for _ in range(7):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.exp(x)
    steps.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(steps)[3])  # the median step
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_keep_freed_blocks_stops_per_step_page_faults():
    def faults_per_step(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _STEP_FAULTS, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    thp_always = "[always]" in Path(memory._THP_MODE).read_text() if Path(memory._THP_MODE).exists() else False
    if not thp_always:  # (with every mapping on 2 MiB pages the fresh pages fault in 512 times fewer)
        assert faults_per_step("default") > 8000  # 64 MiB mapped anew and faulted in, 4 KiB at a time, every step
    assert faults_per_step("keep") < 500  # the last step's pages, reused


def test_trim_on_growth_trims_once_the_resident_set_outgrows_the_working_set(monkeypatch):
    trims = []
    monkeypatch.setattr(memory, "trim_heap", lambda: trims.append(True) or True)
    heap = memory.TrimOnGrowth(margin=0.1, min_kib=100)
    heap.trim()  # what setup freed goes first
    assert len(trims) == 1 and heap.working_set_kib is None
    assert not heap.after_step(4000)  # the first step's footprint is the working set
    assert heap.working_set_kib == 4000
    assert not heap.after_step(4400) and not heap.after_step(None)  # within 10 %, and an unknown size
    assert heap.after_step(4401) and len(trims) == 2  # past it: trimmed, and the working set is measured anew
    assert heap.working_set_kib is None and not heap.after_step(4500) and heap.working_set_kib == 4500
    small = memory.TrimOnGrowth(margin=0.1, min_kib=256 << 10)  # a small run's 10 % is below the floor
    small.after_step(50_000)
    assert not small.after_step(50_000 + (256 << 10)) and small.after_step(50_001 + (256 << 10))


def test_trim_on_growth_returns_what_the_kept_heap_holds():
    """Under keep_freed_blocks a freed 512 MiB block stays resident; once that growth shows after a step, the
    trim gives it back."""
    if platform.system() != "Linux" or _malloc_trim() is None:
        pytest.skip("needs glibc's malloc_trim and /proc/self/status")
    code = r"""
import torch
from seqlab.runtime import memory
memory.keep_freed_blocks()
heap = memory.TrimOnGrowth()
heap.after_step(memory.status_kib("VmRSS"))  # the working set: torch itself
block = torch.ones(128 << 20)  # 512 MiB, touched
pin = torch.ones(1 << 14)
del block
held = memory.status_kib("VmRSS")
trimmed = heap.after_step(held)
print(held // 1024, memory.status_kib("VmRSS") // 1024, trimmed)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    held, after, trimmed = int(out[0]), int(out[1]), out[2] == "True"
    assert trimmed and held - after > 400, (held, after)  # the freed block was resident, and the trim returned it

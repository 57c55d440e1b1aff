"""torch.compile's on-disk graph cache is keyed by the ISA the process runs with (runtime.cpu.compile_keyed_by_isa).

Inductor generates C++ for the vector width it picks and caches that source by graph and settings only; a cache
shared by a native AVX-512 run and an ``ATEN_CPU_CAPABILITY=avx2`` run handed one run the other's loops.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from seqlab.runtime.cpu import isa_above_avx2, key_compile_caches_by_isa

AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}

# In a fresh interpreter (the capability is read once, at import): print the tag, then compile an elementwise
# function through the shared cache and say whether it computed the right values.
_CHILD = """
import torch
from seqlab.runtime.cpu import compile_keyed_by_isa
x = torch.randn(4, 100)
f = compile_keyed_by_isa(lambda t: torch.nn.functional.silu(t) * 2 + 1)
print(torch.compiler.config.cache_key_tag)
print(torch.allclose(f(x), torch.nn.functional.silu(x) * 2 + 1))
"""


def _child(cache_dir, caps: dict[str, str] | None) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in AVX2_CAPS and k != "TORCH_COMPILE_CACHE_KEY_TAG"}
    env.update(caps or {}, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    tag, right = out.stdout.split()
    return tag, right


def test_the_tag_joins_the_users_own_and_is_set_once(monkeypatch):
    config = torch.compiler.config
    monkeypatch.setattr(config, "cache_key_tag", "mine")
    tag = key_compile_caches_by_isa()
    assert config.cache_key_tag == f"mine|{tag}"
    assert key_compile_caches_by_isa() == tag and config.cache_key_tag == f"mine|{tag}"  # idempotent


@pytest.mark.skipif(not isa_above_avx2(), reason="only a CPU above AVX2 runs different vector code under the AVX2 caps")
def test_a_graph_compiled_natively_is_not_reused_under_the_avx2_caps(tmp_path):
    native_tag, native_right = _child(tmp_path, None)  # fills the cache with AVX-512 code
    capped_tag, capped_right = _child(tmp_path, AVX2_CAPS)  # without its own key it read that code back
    assert native_tag != capped_tag
    assert native_right == capped_right == "True"

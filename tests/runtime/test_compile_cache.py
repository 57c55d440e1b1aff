"""torch.compile's on-disk graph cache is keyed by the ISA the process runs with (runtime.cpu.compile_keyed_by_isa).

Inductor's FX graph cache stores the C++ it generates for the vector width it picked, keyed without that width; a
cache shared by a native AVX-512 run and an ``ATEN_CPU_CAPABILITY=avx2`` run handed one run the other's loops.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from seqlab.runtime.cpu import AVX2_CAPS, isa_above_avx2, key_compile_caches_by_isa

# In a fresh interpreter (the capability is read once, at import): compile an elementwise function through the
# shared cache; print the tag, whether the graph came from the cache, and whether it computed the right values.
_CHILD = """
import json
import torch
from torch._dynamo.utils import counters
from seqlab.runtime.cpu import compile_keyed_by_isa
x = torch.randn(4, 100)
f = compile_keyed_by_isa(lambda t: torch.nn.functional.silu(t) * 2 + 1)
right = torch.allclose(f(x), torch.nn.functional.silu(x) * 2 + 1)
print(json.dumps([torch.compiler.config.cache_key_tag, counters["inductor"]["fxgraph_cache_hit"] > 0, right]))
"""


def _child(cache_dir, caps: dict[str, str] | None) -> tuple[str, bool, bool]:
    """(tag, whether the graph was a cache hit, whether the values were right) from a fresh interpreter."""
    env = {k: v for k, v in os.environ.items()
           if k not in AVX2_CAPS and not k.startswith(("TORCHINDUCTOR_", "TORCH_COMPILE_"))}
    env.update(caps or {}, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    tag, hit, right = json.loads(out.stdout.strip().splitlines()[-1])
    return tag, hit, right


def test_the_tag_joins_the_users_own_and_is_set_once(monkeypatch):
    config = torch.compiler.config
    monkeypatch.setattr(config, "cache_key_tag", "mine")
    tag = key_compile_caches_by_isa()
    assert config.cache_key_tag == f"mine|{tag}"
    assert key_compile_caches_by_isa() == tag and config.cache_key_tag == f"mine|{tag}"  # idempotent


@pytest.mark.skipif(not isa_above_avx2(), reason="only a CPU above AVX2 runs different vector code under the AVX2 caps")
def test_a_graph_compiled_natively_is_not_reused_under_the_avx2_caps(tmp_path):
    native = _child(tmp_path, None)  # fills the cache with AVX-512 code
    again = _child(tmp_path, None)
    assert again == (native[0], True, True)  # the cache is in use, and the tag is the same from run to run
    capped = _child(tmp_path, AVX2_CAPS)  # without a key of its own it read the AVX-512 code back
    assert capped[1:] == (False, True) and capped[0] != native[0]
    assert native[1:] == (False, True)

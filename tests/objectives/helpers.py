"""Tiny models and a tokenizer shared by the objective tests (fast on 2 cores)."""

from __future__ import annotations

import torch

from seqlab import ModelConfig, build_model
from seqlab.data import ByteTokenizer

TOK = ByteTokenizer()


def tiny_model(arch: str = "decoder", seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = dict(arch=arch, vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, max_seq_len=128,
               pad_token_id=TOK.pad_id, bos_token_id=TOK.bos_id, eos_token_id=TOK.eos_id)
    cfg.update(kw)
    return build_model(ModelConfig(**cfg))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

"""Tiny runs for the trainer tests: a byte tokenizer, a 2-layer d=32 decoder, a few hundred bytes of text."""

from __future__ import annotations

import pytest
import torch

from seqlab import ModelConfig, build_model
from seqlab.data import ByteTokenizer
from seqlab.objectives import build_objective
from seqlab.train import TrainConfig, Trainer

TEXT = ("Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him. "
        "The evil that men do lives after them; the good is oft interred with their bones. ") * 6


def tiny_model(tok, dropout: float = 0.0, seed: int = 0, dtype: torch.dtype | None = None, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = dict(arch="decoder", vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=2, max_seq_len=64,
               dropout=dropout, pad_token_id=tok.pad_id)
    cfg.update(kw)
    model = build_model(ModelConfig(**cfg))
    return model.to(dtype) if dtype is not None else model


def windows(tok, seq_len: int = 24, ragged: bool = False) -> list[list[int]]:
    """Fixed windows over TEXT; ``ragged`` cuts each to a different length so batches carry padding."""
    ids = tok.encode(TEXT)
    rows = [ids[i: i + seq_len] for i in range(0, len(ids) - seq_len, seq_len - 1)]
    if ragged:
        rows = [r[: 6 + (7 * i) % (seq_len - 6)] for i, r in enumerate(rows)]
    return rows


def make_trainer(tmp_path, *, steps=6, batch_size=4, grad_accum=1, dropout=0.0, objective="clm", data=None,
                 resume=False, callbacks=(), out="run", dtype=None, tensorboard_dir=None, **cfg_kw) -> Trainer:
    tok = ByteTokenizer()
    data = data if data is not None else windows(tok)
    defaults = dict(objective=objective, out_dir=str(tmp_path / out), max_steps=steps, batch_size=batch_size,
                    grad_accum=grad_accum, seq_len=24, lr=3e-3, warmup_steps=2, eval_interval=0, log_interval=1,
                    ckpt_interval=0, progress=False, plot=False, precision="fp32", device="cpu", seed=7)
    defaults.update(cfg_kw)
    cfg = TrainConfig(**defaults)
    return Trainer(cfg, tiny_model(tok, dropout, dtype=dtype), build_objective(objective, tok), data, data[:8],
                   tokenizer=tok, callbacks=callbacks, resume=resume, tensorboard_dir=tensorboard_dir)


@pytest.fixture
def tok():
    return ByteTokenizer()

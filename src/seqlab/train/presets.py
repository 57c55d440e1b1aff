"""Named model sizes for ``seqlab train --preset``. The objective decides the architecture; the tokenizer the vocab.

Sizes are chosen for what they are used for on a laptop-class CPU: ``tiny`` for tests (seconds), ``small`` for
quick experiments (minutes), ``demo`` is the tuned recipe of ``seqlab demo`` (see docs/training.md for how it was
chosen), ``base`` a GPU-sized starting point.
"""

from __future__ import annotations

from typing import Any

from seqlab.config import ModelConfig

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=32, n_layers=2, n_heads=2, max_seq_len=256),
    "small": dict(d_model=128, n_layers=4, n_heads=4, max_seq_len=512),
    "demo": dict(d_model=128, n_layers=4, n_heads=4, max_seq_len=256),
    "base": dict(d_model=512, n_layers=8, n_heads=8, max_seq_len=1024),
    "gpt2": dict(d_model=768, n_layers=12, n_heads=12, max_seq_len=1024, pos="learned", norm="layernorm",
                 mlp="gelu", activation="gelu_tanh", bias=True),
}


def model_config(preset: str, arch: str, tokenizer, seq_len: int, **overrides: Any):
    """A ModelConfig for ``preset`` and ``arch`` whose vocabulary and special ids come from ``tokenizer``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    kw: dict[str, Any] = dict(PRESETS[preset])
    kw.update(arch=arch, vocab_size=tokenizer.vocab_size)
    kw["max_seq_len"] = max(kw.get("max_seq_len", 0), seq_len)
    for name, attr in (("pad_token_id", "pad_id"), ("bos_token_id", "bos_id"), ("eos_token_id", "eos_id")):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            kw[name] = value
    if arch == "encoder_decoder" and kw.get("bos_token_id") is not None:
        kw["decoder_start_token_id"] = kw["bos_token_id"]
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return ModelConfig(**kw)

"""Tiny models and slow-but-obvious reference decoders shared by the generation tests."""
from __future__ import annotations

import torch

from seqlab.config import ModelConfig
from seqlab.model import build_model


def tiny_decoder(seed: int = 0, **overrides):
    """Llama-style: RoPE, GQA (4 query heads over 2 KV heads), SwiGLU, RMSNorm."""
    kw = dict(arch="decoder", vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
              pos="rope", init_std=0.3, tie_embeddings=False)
    kw.update(overrides)
    torch.manual_seed(seed)
    return build_model(ModelConfig(**kw)).eval()


def tiny_encdec(seed: int = 0, **overrides):
    """BART-like encoder-decoder with learned positions and a decoder start token."""
    kw = dict(arch="encoder_decoder", vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
              max_seq_len=64, pos="learned", norm="layernorm", mlp="gelu", init_std=0.3,
              pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    kw.update(overrides)
    torch.manual_seed(seed)
    return build_model(ModelConfig(**kw)).eval()


@torch.no_grad()
def greedy_recompute(model, ids: torch.Tensor, n: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy decoding by a full forward pass over the whole sequence at every step (no cache)."""
    seq = ids.clone()
    m = mask.clone() if mask is not None else torch.ones_like(ids)
    for _ in range(n):
        logits = model(seq, attention_mask=m)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        m = torch.cat([m, torch.ones_like(nxt)], dim=1)
    return seq


@torch.no_grad()
def greedy_recompute_encdec(model, src: torch.Tensor, n: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    start = model.config.decoder_start_token_id
    dec = torch.full((src.shape[0], 1), start, dtype=torch.long)
    for _ in range(n):
        logits = model(src, attention_mask=mask, decoder_input_ids=dec)
        dec = torch.cat([dec, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return dec


def hf_llama_pair(seed: int = 0, **overrides):
    """A random Hugging Face LlamaForCausalLM and the same weights as a seqlab model (via seqlab.io.hf)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from seqlab.io.checkpoint import load_state_into
    from seqlab.io.hf import convert_hf_state_dict

    kw = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3, rms_norm_eps=1e-5,
              bos_token_id=0, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    kw.update(overrides)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    cfg, state = convert_hf_state_dict(hf.config.to_dict(), hf.state_dict())
    model = build_model(cfg)
    load_state_into(model, state, "hf_llama_pair")
    return hf, model.eval()

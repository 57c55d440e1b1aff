"""Tiny models and slow-but-obvious reference decoders shared by the generation tests."""
from __future__ import annotations

import copy

import torch

from seqlab.config import ModelConfig
from seqlab.generate.sampling import apply_repetition_penalty, seen_mask
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


# ----------------------------------------------------------------------------------------------------------
# Token equality between two numerics paths, up to near-ties.
#
# Two paths that compute the same function (cache vs recomputation, a batch vs each row alone, seqlab vs HF, a
# verify pass vs decode steps, packed vs dense weights) differ by float32 rounding, which depends on the kernel and
# the CPU's vector width. On these tiny models the logits are O(1-10) and each path stays within ~1e-5 of the
# float64 value, so the greedy token can only differ where the float64 top-2 gap is below ~2e-5. TIE_TOL leaves a
# wide margin above that and is still far below a typical gap (~0.1-1): a real bug does not hide under it.
TIE_TOL = 1e-3


def float64_copy(model):
    return copy.deepcopy(model).double().eval()


def decoder_oracle(model, ids: torch.Tensor, mask: torch.Tensor | None = None, repetition_penalty: float = 1.0):
    """``f(row, prefix) -> float64 next-token logits``; ``prefix`` is the output row's columns before the token
    (prompt as given, padding included, then new tokens)."""
    m64, T = float64_copy(model), ids.shape[1]

    @torch.no_grad()
    def next_logits(row: int, prefix: torch.Tensor) -> torch.Tensor:
        real = prefix[:T][mask[row].bool()] if mask is not None else prefix[:T]
        seq = torch.cat([real, prefix[T:]])[None]
        logits = m64(seq)[0, -1]
        if repetition_penalty != 1.0:
            seen = seen_mask(seq, None, logits.shape[-1])
            logits = apply_repetition_penalty(logits[None], seen, repetition_penalty)[0]
        return logits

    return next_logits


def encdec_oracle(model, src_rows: list[torch.Tensor]):
    """Like :func:`decoder_oracle` for an encoder-decoder: ``prefix`` is the decoder row (start token first)."""
    m64 = float64_copy(model)

    @torch.no_grad()
    def next_logits(row: int, prefix: torch.Tensor) -> torch.Tensor:
        return m64(src_rows[row][None], decoder_input_ids=prefix[None])[0, -1]

    return next_logits


def assert_same_tokens_up_to_ties(got: torch.Tensor, want: torch.Tensor, start: int, next_logits,
                                  tol: float = TIE_TOL) -> set[int]:
    """Rows of ``got`` and ``want`` agree, except after a step where the float64 logits nearly tie.

    At a row's first difference (column ``j >= start``) both tokens must be within ``tol`` of the best float64
    logit given the common prefix; what follows a tie may legitimately differ. Returns the rows that diverged
    at a tie (callers skip row-specific follow-up checks for them).
    """
    assert got.shape[0] == want.shape[0], (got.shape, want.shape)
    n = min(got.shape[1], want.shape[1])
    tied = set()
    for b in range(got.shape[0]):
        diff = (got[b, :n] != want[b, :n]).nonzero()
        if len(diff) == 0:
            continue
        j = int(diff[0])
        assert j >= start, f"row {b}: the outputs differ at column {j}, inside the prompt"
        logits = next_logits(b, want[b, :j])
        best = float(logits.max())
        for t in (int(got[b, j]), int(want[b, j])):
            gap = best - float(logits[t])
            assert gap < tol, (f"row {b}, new token {j - start}: token {t} is {gap:.2e} below the best float64 "
                               f"logit (tie tolerance {tol:.0e}), so the difference is not rounding")
        tied.add(b)
    return tied

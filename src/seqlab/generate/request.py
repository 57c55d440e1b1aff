"""One request, made ready for any strategy: validated ids and masks, the documented truncation, the first pass.

Everything here happens once per request, before the first token; the loops (``loop``, ``beam``,
``speculative``) start from a :class:`Prepared` request and :func:`open_request`'s filled cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seqlab.generate.config import GenerationConfig
from seqlab.generate.engine import decoder_start_token_id, is_encoder_decoder, prefill
from seqlab.generate.sampling import seen_mask
from seqlab.model.cache import KVCache


@dataclass
class Prepared:
    given_ids: Tensor  # the prompt (or source) as the caller gave it: the output layout starts with it
    input_ids: Tensor  # what the model reads: ``given_ids``, or its last tokens under truncate_prompt
    attention_mask: Tensor | None  # None when every token is real
    lengths: Tensor  # [B] real tokens per row
    last_index: Tensor | None  # [B] for right-padded decoder prompts, else None
    eos: list[int]
    pad: int
    encdec: bool

    def last_tokens(self) -> list[list[int]]:
        """Each row's last prompt token (none for an encoder-decoder, whose output answers its source): the
        context its new text reads on from."""
        if self.encdec:
            return [[] for _ in range(self.input_ids.shape[0])]
        if self.last_index is None:
            return [[t] for t in self.input_ids[:, -1].tolist()]
        return [[t] for t in self.input_ids.gather(1, self.last_index[:, None])[:, 0].tolist()]


def infer_attention_mask(input_ids: Tensor, attention_mask: Tensor | None, pad: int | None, eos: list[int]) -> Tensor | None:
    """Hugging Face's rule: with no mask given, a pad id (that is not also EOS) present in the input marks padding."""
    if attention_mask is not None:
        return attention_mask
    if pad is not None and pad not in eos and bool((input_ids == pad).any()):
        return (input_ids != pad).long()
    return None


def _check_ids(input_ids, vocab_size: int) -> Tensor:
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [batch, length] tensor, got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__}")
    if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}); a prompt needs at least one token")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size:
        raise ValueError(f"input_ids hold ids outside the vocabulary [0, {vocab_size}): "
                         f"min {int(input_ids.min())}, max {int(input_ids.max())}")
    return input_ids.long()


def _check_special_ids(eos: list[int], pad: int, vocab_size: int) -> None:
    """An EOS or pad id the model cannot emit would never stop a row, or would write an unembeddable token."""
    outside = [e for e in eos if not 0 <= e < vocab_size]
    if outside:
        raise ValueError(f"eos_token_id {outside if len(outside) > 1 else outside[0]} is outside the model's "
                         f"vocabulary [0, {vocab_size})")
    if not 0 <= pad < vocab_size:
        raise ValueError(f"pad_token_id {pad} is outside the model's vocabulary [0, {vocab_size})")


def prepare(model, input_ids: Tensor, attention_mask: Tensor | None, cfg: GenerationConfig,
            lookahead: int = 0) -> Prepared:
    """Validate shapes, lengths and special ids; apply the documented truncation; find each row's last real token.
    ``lookahead``: positions a strategy reads past its last new token (speculative decoding's drafts)."""
    mcfg = model.config
    if mcfg.arch == "encoder":  # it sees every position at once: no next token to predict, and no cache
        raise ValueError("generation needs a decoder or an encoder-decoder; this model is an encoder "
                         "(ModelConfig.arch): use it for embeddings or masked-token filling")
    input_ids = _check_ids(input_ids, mcfg.vocab_size)
    given_ids = input_ids
    B, T = input_ids.shape
    eos = cfg.eos_ids(mcfg)
    pad = cfg.pad_id(mcfg)
    _check_special_ids(eos, pad, mcfg.vocab_size)
    explicit_pad = cfg.pad_token_id if cfg.pad_token_id is not None else getattr(mcfg, "pad_token_id", None)
    attention_mask = infer_attention_mask(input_ids, attention_mask, explicit_pad, eos)
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
        attention_mask = attention_mask.to(input_ids.device).long()
        if bool(attention_mask.all()):
            attention_mask = None
    lengths = attention_mask.sum(1) if attention_mask is not None else torch.full((B,), T, device=input_ids.device)
    if int(lengths.min()) == 0:
        raise ValueError(f"row {int(lengths.argmin())} of the batch has no real prompt tokens (attention_mask all 0)")

    encdec = is_encoder_decoder(model)
    limit = mcfg.max_seq_len
    longest = int(lengths.max())
    reach = cfg.max_new_tokens + lookahead  # positions past the prompt that a learned table must hold
    if longest > limit or (not encdec and mcfg.pos == "learned" and longest + reach > limit):
        need = longest if longest > limit else longest + reach
        what = "prompt" if not encdec else "source"
        if not cfg.truncate_prompt:
            ahead = f" + the drafts' look-ahead {lookahead}" if lookahead else ""
            size = (f"{longest} tokens" if longest > limit
                    else f"{longest} tokens + max_new_tokens={cfg.max_new_tokens}{ahead} = {need}")
            lower = "" if longest > limit else "lower max_new_tokens (--max-new-tokens), "
            raise ValueError(
                f"{what} of {size} exceeds the model's context (ModelConfig.max_seq_len={limit}); shorten it, "
                f"{lower}or set GenerationConfig.truncate_prompt=True to keep the last tokens (on the command line: "
                "--truncate)")
        keep = limit if (encdec or mcfg.pos != "learned") else limit - reach
        if keep < 1:
            raise ValueError(f"max_new_tokens={cfg.max_new_tokens} leaves no room for a prompt in the context "
                             f"(ModelConfig.max_seq_len={limit})")
        if attention_mask is not None and not bool(attention_mask[:, -1].all()):
            raise ValueError("truncate_prompt needs left-padded (or unpadded) prompts")
        input_ids = input_ids[:, -keep:]
        attention_mask = attention_mask[:, -keep:] if attention_mask is not None else None
        lengths = lengths.clamp(max=keep)

    if encdec and getattr(mcfg, "pos", None) == "learned" and 1 + cfg.max_new_tokens > limit:
        raise ValueError(f"max_new_tokens={cfg.max_new_tokens} + the decoder start token exceeds the decoder's "
                         f"learned positions (ModelConfig.max_seq_len={limit})")
    last_index = None
    if not encdec and attention_mask is not None and not bool(attention_mask[:, -1].all()):
        cols = torch.arange(input_ids.shape[1], device=input_ids.device)
        last_index = (attention_mask * (cols + 1)).argmax(dim=1)  # right padding: the last real column per row
    return Prepared(given_ids, input_ids, attention_mask, lengths, last_index, eos, pad, encdec)


def open_request(model, prep: Prepared, max_new: int) -> tuple[KVCache, Tensor, Tensor]:
    """Allocate the request's cache and prefill it.

    Returns (cache, next-token logits ``[B, V]``, position ids ``[B, 1]`` of the first new token).
    """
    device = prep.input_ids.device
    B, T = prep.input_ids.shape
    dtype = next(model.parameters()).dtype
    if prep.encdec:
        cache = model.new_cache(B, 1 + max_new, dtype=dtype, device=device)
        logits = prefill(model, prep.input_ids, cache, prep.attention_mask)
        return cache, logits, torch.ones(B, 1, dtype=torch.long, device=device)
    # positions count each row's real tokens: a batch padded wider than its prompts still fits a position table or
    # attention window that its longest prompt + max_new fits, as `prepare` checked
    cache = model.new_cache(B, T + max_new, dtype=dtype, device=device, positions=int(prep.lengths.max()) + max_new)
    logits = prefill(model, prep.input_ids, cache, prep.attention_mask, last_index=prep.last_index)
    return cache, logits, prep.lengths.view(B, 1).clone()


def seen_tokens(model, prep: Prepared, cfg: GenerationConfig) -> Tensor | None:
    """The repetition penalty's [B, V] mask of tokens already in the context (None when there is no penalty)."""
    if cfg.repetition_penalty == 1.0:
        return None
    V = model.config.vocab_size
    if prep.encdec:
        B = prep.input_ids.shape[0]
        start = torch.full((B, 1), decoder_start_token_id(model), dtype=torch.long, device=prep.input_ids.device)
        return seen_mask(start, None, V)
    return seen_mask(prep.input_ids, prep.attention_mask, V)


def make_generator(cfg: GenerationConfig, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if cfg.seed is None:
        g.seed()
    else:
        g.manual_seed(int(cfg.seed))
    return g


def strategy_of(cfg: GenerationConfig, draft_model) -> str:
    if draft_model is not None:
        if cfg.num_beams > 1:
            raise ValueError("a draft model means speculative decoding, which keeps one beam: use num_beams=1, "
                             "or beam search without the draft model")
        return "speculative"
    if cfg.num_beams > 1:
        return "beam"
    return "greedy" if cfg.greedy else "sample"

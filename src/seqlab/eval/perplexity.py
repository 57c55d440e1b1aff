"""Perplexity and bits per byte of a whole text, scored in a sliding window of the model's context.

Why a sliding window: a text longer than the context cannot be scored in one pass, and cutting it into disjoint
chunks scores each chunk's first tokens with no context at all, which inflates perplexity. Here every token is
scored once, predicted from at least ``window - stride`` tokens of context (all it has, near the start). With a
BOS token every text token is scored; without one, the first token has no prediction and is left out of both
the token and byte counts. With every text token scored the bytes are the text's own UTF-8 bytes; without BOS the
first token's bytes (the tokenizer's per-token byte lengths, :mod:`seqlab.eval.metrics`) are taken off them. The text
is the measure, not its pieces: a SentencePiece tokenizer puts a '▁' before the first word that is not in the text.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from seqlab.data.tokenizer import Tokenizer
from seqlab.eval.metrics import bits_per_byte, perplexity

_HEAD_ROWS = 256  # positions sent through the LM head at a time (a 49k-token head makes big logit blocks)


@dataclass
class TextScore:
    perplexity: float
    bits_per_byte: float
    tokens: int
    bytes: int
    nll: float
    window: int
    stride: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def sliding_window_nll(model: torch.nn.Module, ids: list[int], window: int, stride: int) -> tuple[float, list[int]]:
    """Summed NLL (nats) of ``ids[1:]`` given their prefixes, and the positions scored (each exactly once)."""
    if not 0 < stride < window:  # a window's first new token is predicted from the position before it
        raise ValueError(f"stride {stride} must be in 1..{window - 1} (the window, {window}, less one): every "
                         f"scored token needs at least one token of context in its window")
    total, scored, done = 0.0, [], 1  # position 0 has no prediction
    begin = 0
    while done < len(ids):
        end = min(begin + window, len(ids))
        x = torch.tensor([ids[begin:end]])
        hidden = model.body(x)[0]  # [T, d]
        first = done - begin  # first position of this window not scored before (its target index)
        for i in range(first, end - begin, _HEAD_ROWS):
            j = min(end - begin, i + _HEAD_ROWS)
            logits = model.head(hidden[i - 1 : j - 1]).float()
            total += float(F.cross_entropy(logits, x[0, i:j], reduction="sum"))
        scored.extend(range(begin + first, end))
        done = end
        if end == len(ids):
            break
        begin += stride  # the next window ends `stride` tokens later; its first window - stride are context
    return total, scored


def _first_token_bytes(tok: Tokenizer, text: str, first: int) -> int:
    """The bytes of ``text`` that its first token covers: the token decoded alone, as the text spells it (a special
    token's spelling, which the byte table counts 0; no '▁' that a SentencePiece tokenizer adds before the first word,
    which the table counts 1), or, where that is part of a character (a byte-level piece of an emoji), the table's."""
    alone = tok.decode([first], skip_special_tokens=False)
    return tok.byte_lengths()[first] if "\ufffd" in alone else len(alone.encode("utf-8"))


def score_text(model: torch.nn.Module, tok: Tokenizer, text: str, window: int | None = None,
               stride: int | None = None, bos: bool | None = None) -> TextScore:
    """Perplexity and bits per byte of ``text`` under ``model`` (eval mode, no grad).

    ``bos``: start with BOS. None follows the tokenizer's own rule (``encode(add_special_tokens=True)``), as
    prompts do: a seqlab decoder's documents start with BOS, an HF or GGUF model adds one where its
    ``add_bos_token`` says (SmolLM2's does not), as transformers' ``tok(text)`` and llama.cpp's perplexity read it.
    Without BOS the first token is context only, and its bytes are left out of bits per byte."""
    if model.config.arch != "decoder":  # an encoder sees the token it would predict: its "perplexity" means nothing
        raise ValueError(f"perplexity scores a causal decoder's next-token predictions; this model is an "
                         f"{model.config.arch} (ModelConfig.arch): use `seqlab eval RUN` for its own objective")
    window = int(window or model.config.max_seq_len)
    window = min(window, model.config.max_seq_len)
    stride = int(stride or max(1, window // 2))
    bos_id = getattr(tok, "bos_id", None)
    bos = (tok.adds_bos if bos is None else bos) and bos_id is not None
    ids = [bos_id] * bos + tok.encode(text)
    if len(ids) < 2:
        raise ValueError("the text is too short to score (fewer than two tokens)")
    model.eval()
    nll, scored = sliding_window_nll(model, ids, window, stride)
    n_bytes = len(text.encode("utf-8"))
    if not bos:  # the first text token is context only
        n_bytes = max(n_bytes - _first_token_bytes(tok, text, ids[0]), 0)
    return TextScore(perplexity(nll, len(scored)), bits_per_byte(nll, n_bytes), len(scored), n_bytes, nll,
                     window, stride)

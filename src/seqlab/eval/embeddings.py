"""Sentence embeddings from an encoder: mean pooling over real tokens, then L2 normalisation.

This is what sentence-transformers computes for all-MiniLM-L6-v2. It lives in eval/ because it is a read-only use
of a model that yields numbers to compare (cosine similarity), like perplexity: it needs the model and the
tokenizer (layers below eval) and no file format (that is io/'s job) and no command line (cli/'s).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from seqlab.data import Tokenizer
from seqlab.runtime import progress


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """[B, T, d] hidden states -> [B, d], averaged over positions where the mask is 1 (padding excluded)."""
    m = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


@torch.no_grad()
def sentence_embeddings(model, tokenizer: Tokenizer, texts: Sequence[str], max_length: int = 256,
                        batch_size: int = 32, show_progress: bool = False) -> Tensor:
    """[N, d] float32 unit vectors, one per text.

    Rows are padded to the longest in each batch; the attention mask keeps padding out of both attention and the
    mean, so a sentence's embedding does not depend on what it is batched with. Over-long inputs keep their first
    ``max_length - 1`` tokens and the final one ([SEP]).
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    out = []
    starts = range(0, len(texts), batch_size)
    for i in progress(starts, desc="embedding", unit="batch", enabled=show_progress, delay=2.0):
        batch = [ids[: max_length - 1] + ids[-1:] if len(ids) > max_length else ids
                 for ids in tokenizer.encode_batch(list(texts[i: i + batch_size]), add_special_tokens=True)]
        ids, mask = tokenizer.pad(batch, side="right")
        h = model.body(ids, attention_mask=mask).float()
        out.append(F.normalize(mean_pool(h, mask), p=2, dim=1))
    return torch.cat(out) if out else torch.empty(0, model.config.d_model)

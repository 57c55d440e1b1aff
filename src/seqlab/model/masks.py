"""Every attention mask and every position id of seqlab is built here, in one place.

Convention: a boolean mask is True where attention is *allowed*. Shapes broadcast against SDPA's
[batch, heads, queries, keys]. A query whose keys are all masked would make SDPA's softmax return NaN (0/0), so
``ensure_attendable`` lets such rows (only ever padding queries or empty sources) see every key instead: their
outputs are discarded anyway, and no NaN can leak into sums over the batch.
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(n_queries: int, n_keys: int | None = None, offset: int = 0, device=None) -> Tensor:
    """[Tq, Tk] mask where query i (at absolute slot offset+i) sees keys at slots <= offset+i."""
    n_keys = n_queries + offset if n_keys is None else n_keys
    q = torch.arange(n_queries, device=device)[:, None] + offset
    k = torch.arange(n_keys, device=device)[None, :]
    return k <= q


def padding_mask(key_valid: Tensor) -> Tensor:
    """[B, S] key validity (1 = real token) -> [B, 1, 1, S] boolean mask."""
    return key_valid.bool()[:, None, None, :]


def ensure_attendable(mask: Tensor) -> Tensor:
    """Let rows with no visible key see all keys, so SDPA never divides 0 by 0 (NaN)."""
    return mask | ~mask.any(dim=-1, keepdim=True)


def positions_from_mask(attention_mask: Tensor, start: Tensor | int = 0) -> Tensor:
    """Position ids that ignore padding: each real token gets the index it would have without padding.

    ``start`` is the number of real tokens already seen by the row (a [B] tensor when decoding on a cache).
    Padding positions get a clamped, harmless id.
    """
    mask = attention_mask.long()
    pos = mask.cumsum(-1) - 1
    if isinstance(start, Tensor):
        pos = pos + start[:, None]
    else:
        pos = pos + start
    return pos.clamp_min(0)


def document_mask(document_ids: Tensor, causal: bool = True) -> Tensor:
    """[B, T] document ids of packed rows -> [B, 1, T, T]: no attention across documents.

    Ids < 0 mark padding; padding keys are invisible to every query.
    """
    same = document_ids[:, :, None] == document_ids[:, None, :]
    same &= (document_ids >= 0)[:, None, :]
    if causal:
        T = document_ids.shape[1]
        same &= causal_mask(T, device=document_ids.device)
    return ensure_attendable(same[:, None])


def positions_from_documents(document_ids: Tensor) -> Tensor:
    """Positions restart at 0 at the start of every packed document."""
    B, T = document_ids.shape
    idx = torch.arange(T, device=document_ids.device).expand(B, T)
    is_start = torch.ones_like(document_ids, dtype=torch.bool)
    is_start[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_idx = torch.where(is_start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_idx


def cached_self_attention_mask(valid: Tensor, start: int, n_new: int) -> Tensor | None:
    """Mask for ``n_new`` queries written at cache slots [start, start+n_new) over keys in slots [0, start+n_new).

    ``valid`` is the cache's [B, max_len] slot validity. Returns None when nothing needs masking (every slot valid
    and either a single query or the plain causal prefill case is handled by the caller).
    """
    end = start + n_new
    keys = valid[:, :end]
    mask = keys[:, None, None, :]
    if n_new > 1:
        mask = mask & causal_mask(n_new, end, offset=start, device=valid.device)
    return ensure_attendable(mask)


def positions(batch: int, length: int, attention_mask: Tensor | None = None, document_ids: Tensor | None = None,
              device=None) -> Tensor:
    """Position ids of one pass without a cache: restart per packed document, skip padding, else 0..T-1."""
    if document_ids is not None:
        return positions_from_documents(document_ids)
    if attention_mask is not None:
        return positions_from_mask(attention_mask)
    return torch.arange(length, device=device).expand(batch, length)


def self_attention_mask(length: int, causal: bool, attention_mask: Tensor | None = None,
                        document_ids: Tensor | None = None) -> Tensor | None:
    """The mask of one pass without a cache, or None where SDPA's own masking (``is_causal`` or none) is exact."""
    if document_ids is not None:
        return document_mask(document_ids, causal=causal)
    if attention_mask is None:
        return None
    mask = padding_mask(attention_mask)
    if causal:
        mask = mask & causal_mask(length, device=attention_mask.device)
    return ensure_attendable(mask)


def cached_positions(cache, batch: int, length: int, attention_mask: Tensor | None = None, device=None) -> Tensor:
    """Position ids of ``length`` new tokens per row: each row continues from the real tokens it already holds."""
    start = cache.pos
    if attention_mask is None and cache.dense:
        return torch.arange(start, start + length, device=device).expand(batch, length)
    new = torch.ones(batch, length, dtype=torch.long, device=device) if attention_mask is None else attention_mask
    return positions_from_mask(new, start=cache.lengths())


def cached_attention(cache, n_new: int) -> tuple[Tensor | None, bool]:
    """(mask, is_causal) for ``n_new`` queries at the cache's reserved slots, over every slot written so far.

    A dense cache (no padding, no holes) needs no mask: plain causal attention for a prefill, none at all for one
    query. ``n_new`` is tested first so a decode step never compares the cache's fill level, which torch.compile
    treats as symbolic (a SymBool cannot be SDPA's ``is_causal``; the graph would break at every layer).
    """
    start = cache.pos
    if cache.dense and (n_new == 1 or start == 0):
        return None, n_new > 1
    return cached_self_attention_mask(cache.valid, start, n_new), False

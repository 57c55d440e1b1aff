"""Padding: lists of token ids -> rectangular tensors plus the masks that say which entries are real.

Two masks, two jobs (the seed insists on keeping them apart): the *attention* mask (1 = real token, 0 = pad) decides
what a query may look at; the *labels* (-100 = ignore) decide which positions are scored. Padding is excluded from
both. Right padding is the default for training (positions then need no adjustment); left padding is what batched
generation wants, and the core derives positions from the attention mask either way.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

IGNORE_INDEX = -100
PADDING_SIDES = ("right", "left")


def pad_sequences(seqs: Sequence[Sequence[int]], pad_value: int, side: str = "right",
                  length: int | None = None, dtype: torch.dtype = torch.long) -> Tensor:
    """[B, L] tensor, L = ``length`` or the longest sequence; ``side`` is where the padding goes."""
    if side not in PADDING_SIDES:
        raise ValueError(f"padding side must be 'right' or 'left', got {side!r}")
    if not seqs:
        raise ValueError("cannot pad an empty batch")
    longest = max(len(s) for s in seqs)
    L = longest if length is None else length
    if L < longest:
        raise ValueError(f"pad length {L} is shorter than the longest sequence ({longest})")
    out = torch.full((len(seqs), L), pad_value, dtype=dtype)
    for i, s in enumerate(seqs):
        if len(s):
            t = torch.as_tensor(list(s), dtype=dtype)
            if side == "right":
                out[i, : len(s)] = t
            else:
                out[i, L - len(s):] = t
    return out


def pad_with_mask(seqs: Sequence[Sequence[int]], pad_value: int, side: str = "right",
                  length: int | None = None) -> tuple[Tensor, Tensor]:
    """(ids [B, L], attention_mask [B, L] with 1 on real tokens)."""
    ids = pad_sequences(seqs, pad_value, side, length)
    mask = pad_sequences([[1] * len(s) for s in seqs], 0, side, ids.shape[1])
    return ids, mask


def pad_labels(seqs: Sequence[Sequence[int]], side: str = "right", length: int | None = None) -> Tensor:
    """Labels padded with IGNORE_INDEX so padded positions never count as targets."""
    return pad_sequences(seqs, IGNORE_INDEX, side, length)

"""A static, preallocated key/value cache (gpt-fast style), shared by language models and the NNQS sampler.

Why this shape: allocating once per request and writing at explicit slots costs nothing per decode step, unlike a
cache that grows by concatenation. All rows of a batch write the same slot range (one pointer, ``pos``); rows that
hold padding or rolled-back tokens simply mark those slots invalid in ``valid``. Attention only reads valid slots,
and rotary positions come from the count of valid slots, so "holes" left by left-padding or by a per-row ``crop``
are harmless.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor


class CacheOverflowError(RuntimeError):
    """Raised instead of silently wrapping when a write would exceed the cache's ``max_len``."""


def unfilled(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None) -> Tensor:
    """A cache's default storage. Attention reads only slots [0, pos), and every row writes each of them
    (``update``) before they are read, padding and rolled-back slots included. Zeros would cost a pass over the
    whole cache per request, and its whole size in resident memory up front, however little of it is used."""
    return torch.empty(shape, dtype=dtype, device=device)


Storage = Callable[..., Tensor]  # storage(shape, dtype=..., device=...), as torch.empty and torch.zeros take them


class KVCache:
    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        storage: Storage | None = None,
    ):
        """``storage(shape, dtype=, device=)`` allocates each layer's keys and values (default :func:`unfilled`)."""
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        alloc = storage or unfilled
        self.k = [alloc(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [alloc(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.pos = 0
        self.max_len = max_len
        # True while every written slot of every row is valid: decode steps then need no mask at all, and knowing
        # it from a Python flag (rather than reducing ``valid`` each step) keeps the decode step free of syncs.
        self.dense = True
        # encoder-decoder models: cross-attention K/V, computed once per encoder output and reused every step
        self.cross_k: list[Tensor | None] = [None] * n_layers
        self.cross_v: list[Tensor | None] = [None] * n_layers
        self.memory_mask: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    def lengths(self) -> Tensor:
        """[B] number of real tokens held by each row (its fill level)."""
        return self.valid[:, : self.pos].sum(dim=1)

    def reserve(self, n_new: int, new_valid: Tensor | None = None) -> None:
        """Claim slots [pos, pos+n_new) for the next forward pass and record which of them hold real tokens.

        ``new_valid`` [B, n_new] marks real tokens; None means all of them are real.
        """
        if self.pos + n_new > self.max_len:
            raise CacheOverflowError(
                f"KV cache overflow: it holds {self.max_len} positions, {self.pos} are used and {n_new} more were "
                f"requested; allocate a larger cache (max_len) or shorten the prompt/generation"
            )
        if new_valid is None:
            self.valid[:, self.pos : self.pos + n_new] = True
        else:
            self.valid[:, self.pos : self.pos + n_new] = new_valid
            self.dense = self.dense and bool(new_valid.all())

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write this step's K/V at the reserved slots; return K/V for every slot written so far."""
        start, end = self.pos, self.pos + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        keys, values = self.k[layer][:, :, :end], self.v[layer][:, :, :end]
        if keys.dtype != k.dtype:  # e.g. an fp32 cache under bf16 autocast
            keys, values = keys.to(k.dtype), values.to(k.dtype)
        return keys, values

    def advance(self, n_new: int) -> None:
        self.pos += n_new

    def crop(self, n: int | Tensor) -> None:
        """Roll back to the first ``n`` slots (speculative decoding rejects drafted tokens this way).

        With a [B] tensor, row b keeps slots < n[b]; the write pointer stays at max(n) and the other rows' dropped
        slots become invalid holes, which attention skips.
        """
        if isinstance(n, Tensor):
            n = n.to(self.valid.device)
            lo, hi = int(n.min()), int(n.max())
            if lo < 0 or hi > self.pos:  # past pos would expose slots never written (the cache starts unfilled)
                raise ValueError(f"crop({n.tolist()}) outside the filled range [0, {self.pos}]")
            slots = torch.arange(self.max_len, device=self.valid.device)
            self.valid &= slots[None, :] < n[:, None]
            self.pos = hi
            self.dense = self.dense and bool((n == self.pos).all())
        else:
            if not 0 <= n <= self.pos:
                raise ValueError(f"crop({n}) outside the filled range [0, {self.pos}]")
            self.valid[:, n:] = False
            self.pos = n

    def reorder(self, index: Tensor) -> None:
        """Select/repeat batch rows (beam search reorders beams; the NNQS sampler branches prefixes).

        ``index`` may be longer or shorter than the batch: the cache then changes batch size.
        """
        index = index.to(self.valid.device)
        self.k = [t.index_select(0, index) for t in self.k]
        self.v = [t.index_select(0, index) for t in self.v]
        self.valid = self.valid.index_select(0, index)
        self.cross_k = [None if t is None else t.index_select(0, index) for t in self.cross_k]
        self.cross_v = [None if t is None else t.index_select(0, index) for t in self.cross_v]
        if self.memory_mask is not None:
            self.memory_mask = self.memory_mask.index_select(0, index)

    def select(self, index: Tensor) -> "KVCache":
        """A new cache holding rows ``index`` of this one; this cache is left untouched.

        The NNQS sampler uses it to split one wide level of prefixes into chunks that each branch on their own.
        """
        selected = copy.copy(self)
        selected.reorder(index)  # reorder rebinds every tensor, so the shallow copy shares nothing it writes
        return selected

    @property
    def nbytes(self) -> int:
        tensors = [*self.k, *self.v, self.valid, *(t for t in (*self.cross_k, *self.cross_v) if t is not None)]
        return sum(t.numel() * t.element_size() for t in tensors)

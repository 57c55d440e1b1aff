"""A KV cache whose rows are independent slots, each at its own fill level (for continuous batching).

Why: :class:`KVCache` writes every row at one shared pointer, which suits a batch that starts together. A server's
batch does not: requests join and leave at any step, so each row must write its next token right after its own
history. ``SlotKVCache`` keeps the same storage ([rows, kv_heads, max_len, head_dim] per layer) and the same
interface the model uses (``reserve``/``update``/``advance``, ``pos``, ``valid``, ``dense``, ``batch_size``), but
each row b writes at ``fill[b]``. Live rows are kept packed at the front (rows [0, active)): a decode step runs on
that prefix as a plain view, and a leaving row is replaced by the last live one (``move_row``), so no step ever
gathers the batch.

A decode step over rows at different fill levels reads keys [0, max fill] and masks each row's unfilled slots
through ``valid`` (the model's usual cached-attention mask); when every live row has the same fill the mask is not
needed (``dense``), exactly as for a plain cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqlab.model.cache import CacheOverflowError, KVCache, Storage


class SlotKVCache(KVCache):
    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 storage: Storage | None = None):
        """``storage`` must return zeros (default ``torch.zeros``; a server passes zeros the OS supplies on first
        touch): unlike the base cache, a step here reads slots some rows never wrote, masked through ``valid``,
        and a masked weight is exactly 0, but 0 times a NaN left in unfilled memory is NaN."""
        super().__init__(n_layers, n_slots, n_kv_heads, head_dim, max_len, dtype=dtype, device=device,
                         storage=storage or torch.zeros)
        self.n_slots = n_slots
        self.active = 0  # live rows are [0, active)
        self.fill = torch.zeros(n_slots, dtype=torch.long, device=device)  # tokens held by each row
        self._fills: list[int] = [0] * n_slots  # the same, on the host: the step's key range needs no device sync

    # The base class stores ``valid`` and ``pos`` as attributes; here both are derived from the live rows.
    @property
    def valid(self) -> Tensor:
        return self._valid[: self.active]

    @valid.setter
    def valid(self, value: Tensor) -> None:
        self._valid = value

    @property
    def pos(self) -> int:
        """Where this step's keys end before it writes: the longest live row's fill."""
        return max(self._fills[: self.active], default=0)

    @pos.setter
    def pos(self, value: int) -> None:  # the base constructor's ``pos = 0``; slots never share one pointer
        if value != 0:
            raise ValueError("SlotKVCache has one fill level per row; it has no shared write pointer")

    @property
    def dense(self) -> bool:
        live = self._fills[: self.active]
        return all(f == live[0] for f in live)

    @dense.setter
    def dense(self, value: bool) -> None:  # derived from the fill levels, never stored
        pass

    def lengths(self) -> Tensor:
        return self.fill[: self.active].clone()

    def positions(self) -> Tensor:
        """[active, 1] position ids of the next token of each live row (its fill level)."""
        return self.fill[: self.active].view(-1, 1).clone()

    # ------------------------------------------------------------------------------------------ model interface
    def reserve(self, n_new: int, new_valid: Tensor | None = None) -> None:
        if n_new != 1 or new_valid is not None:
            raise ValueError("SlotKVCache decodes one real token per live row; prefill a row in its own KVCache "
                             "and copy it in with load_row")
        if self.pos + 1 > self.max_len:
            raise CacheOverflowError(f"KV cache overflow: a row already holds all {self.max_len} positions")
        n = self.active
        self._valid[torch.arange(n, device=self.fill.device), self.fill[:n]] = True

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        n, end = self.active, self.pos + 1
        index = self.fill[:n].view(n, 1, 1, 1).expand(n, k.shape[1], 1, k.shape[3])
        keys, values = self.k[layer][:n], self.v[layer][:n]
        keys.scatter_(2, index, k.to(keys.dtype))
        values.scatter_(2, index, v.to(values.dtype))
        keys, values = keys[:, :, :end], values[:, :, :end]
        if keys.dtype != k.dtype:
            keys, values = keys.to(k.dtype), values.to(k.dtype)
        return keys, values

    def advance(self, n_new: int) -> None:
        self.fill[: self.active] += n_new
        for b in range(self.active):
            self._fills[b] += n_new

    def crop(self, n) -> None:
        raise NotImplementedError("SlotKVCache rows are freed with release_row, not cropped")

    def reorder(self, index: Tensor) -> None:
        raise NotImplementedError("SlotKVCache rows keep their place; use move_row/release_row")

    # ------------------------------------------------------------------------------------------ slot management
    def claim_row(self) -> int:
        """Make the next free row live (empty) and return its index."""
        if self.active == self.n_slots:
            raise RuntimeError(f"all {self.n_slots} KV slots are in use")
        row = self.active
        self._valid[row] = False
        self.fill[row] = 0
        self._fills[row] = 0
        self.active += 1
        return row

    def load_row(self, row: int, source: KVCache, n: int) -> None:
        """Copy the first ``n`` positions of row 0 of ``source`` (a request's own prefill cache) into ``row``."""
        if n > self.max_len:
            raise CacheOverflowError(f"a {n}-token prefix does not fit a {self.max_len}-position slot")
        if not 0 <= n <= source.pos:  # beyond it the source holds unfilled memory, which would become valid here
            raise ValueError(f"load_row: {n} positions asked of a cache that holds {source.pos}")
        for layer in range(len(self.k)):
            self.k[layer][row, :, :n] = source.k[layer][0, :, :n]
            self.v[layer][row, :, :n] = source.v[layer][0, :, :n]
        self._valid[row] = False
        self._valid[row, :n] = True
        self.fill[row] = n
        self._fills[row] = n

    def move_row(self, src: int, dst: int) -> None:
        """Copy live row ``src`` (its filled positions) over row ``dst``."""
        n = self._fills[src]
        for layer in range(len(self.k)):
            self.k[layer][dst, :, :n] = self.k[layer][src, :, :n]
            self.v[layer][dst, :, :n] = self.v[layer][src, :, :n]
        self._valid[dst] = self._valid[src]
        self.fill[dst] = n
        self._fills[dst] = n

    def release_row(self, row: int) -> int | None:
        """Free live row ``row``; the last live row moves into its place. Returns the row that moved, or None."""
        if not 0 <= row < self.active:
            raise ValueError(f"row {row} is not live (live rows: 0..{self.active - 1})")
        last = self.active - 1
        moved = None
        if row != last:
            self.move_row(last, row)
            moved = last
        self._valid[last] = False
        self.fill[last] = 0
        self._fills[last] = 0
        self.active -= 1
        return moved

    def fill_of(self, row: int) -> int:
        return self._fills[row]

"""Packing: many short documents into few fixed-length rows, without letting them see each other.

Padding short documents to the longest one wastes compute on PAD; packing fills each row with several documents
instead. To keep the result *equal* to training on the documents one per row, every packed row carries
``document_ids`` ([T], -1 on padding): the core turns them into a block-diagonal causal mask (no attention across
documents) and restarts positions at each document start, and the CLM shift drops the one target that would cross
a document boundary. ``tests/data/test_packing.py`` checks the loss equals the unpacked batch.

Documents are never split across rows (a split document would restart its positions mid-text and lose context);
documents longer than a row are cut into row-sized chunks first, each one after the first opening with the last
token of the one before as its context. Placement is best-fit decreasing (O(n log n)),
deterministic.
"""

from __future__ import annotations

import bisect
from typing import Sequence

PAD_DOCUMENT = -1


def chunk(ids: Sequence[int], size: int) -> list[list[int]]:
    """A document as pieces of at most ``size`` tokens. Pieces of a longer one overlap by a token: a piece's first
    position is never a target (it opens a document), so that token is the context of the next, and every token
    after the document's first is a target once, as in the stream's windows (cut end to end, one was lost per cut)."""
    if len(ids) <= size:
        return [list(ids)]
    return [list(ids[i: i + size]) for i in range(0, len(ids) - 1, size - 1)]


def pack_documents(docs: Sequence[Sequence[int]], seq_len: int, pad_id: int) -> list[dict[str, list[int]]]:
    """-> rows ``{"input_ids": [seq_len], "document_ids": [seq_len]}``; document ids count up within a row from 0.

    ``docs`` are already tokenised (include BOS/EOS yourself if the objective wants them).
    """
    if seq_len < 2:  # a row must hold a target after its context
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    pieces = [c for d in docs for c in chunk(d, seq_len) if c]
    order = sorted(range(len(pieces)), key=lambda i: (-len(pieces[i]), i))  # stable: ties keep input order
    rows: list[list[list[int]]] = []
    free: list[int] = []
    open_rows: list[tuple[int, int]] = []  # sorted (free space, row index) of rows with room left
    for i in order:
        p = pieces[i]
        k = bisect.bisect_left(open_rows, (len(p), -1))  # best fit: the tightest row that still holds p
        if k < len(open_rows):
            space, r = open_rows.pop(k)
        else:
            r, space = len(rows), seq_len
            rows.append([])
            free.append(seq_len)
        rows[r].append(p)
        free[r] = space - len(p)
        if free[r] > 0:
            bisect.insort(open_rows, (free[r], r))
    out = []
    for row, space in zip(rows, free):
        ids = [t for p in row for t in p] + [pad_id] * space
        doc = [k for k, p in enumerate(row) for _ in p] + [PAD_DOCUMENT] * space
        out.append({"input_ids": ids, "document_ids": doc})
    return out


def packing_efficiency(rows: Sequence[dict[str, list[int]]]) -> float:
    """Fraction of row slots that hold real tokens."""
    total = sum(len(r["document_ids"]) for r in rows)
    return sum(d >= 0 for r in rows for d in r["document_ids"]) / max(total, 1)

"""The greedy / sampling loop: prefill, then one decode step per new token, until every row has stopped.

A row stops at EOS or, through its :class:`~seqlab.generate.text.TextStream`, at a stop string. With
``compact_finished`` finished rows leave the batch and the cache (``cache.reorder``) so they stop costing compute;
``rows`` maps each live batch row back to its original row.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from seqlab.eval import timing
from seqlab.generate.config import GenerationConfig
from seqlab.generate.engine import step_fn
from seqlab.generate.metrics import GenerationMetrics
from seqlab.generate.request import Prepared, make_generator, open_request, seen_tokens
from seqlab.generate.sampling import LogitsProcessor, mark_seen
from seqlab.generate.text import StreamChunk, TextStream, chunk_for


def sample_loop(model, prep: Prepared, cfg: GenerationConfig, text: TextStream | None, metrics: GenerationMetrics,
                want_chunks: bool, clock: timing.Stopwatch | None = None) -> Iterator[StreamChunk]:
    """Generator: yields one chunk per step (when ``want_chunks``), returns the new-token block ``[B, steps]``.
    ``clock`` started with the request (its input checks count in the TTFT)."""
    device = prep.input_ids.device
    B = prep.input_ids.shape[0]
    max_new = cfg.max_new_tokens
    proc = LogitsProcessor(cfg.sampling())
    gen = None if proc.greedy else make_generator(cfg, device)
    clock = clock or timing.Stopwatch(device)
    cache, logits, pos_ids = open_request(model, prep, max_new)
    seen = seen_tokens(model, prep, cfg)
    metrics.kv_cache_bytes = cache.nbytes

    out = torch.full((B, max_new), prep.pad, dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)  # original row of each live cache row
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    eos = torch.tensor(prep.eos, dtype=torch.long, device=device) if prep.eos else None
    new_tokens = steps = 0
    decode = step_fn(model, cfg.compile)
    for step in range(max_new):
        if step > 0:
            logits = decode(tok, cache, pos_ids)
            pos_ids += 1
            steps += 1
        tok = proc.select(logits, seen, gen)
        if not cfg.compact_finished:
            tok = tok.masked_fill(~unfinished, prep.pad)
        out[rows, step] = tok
        if seen is not None:
            mark_seen(seen, tok)
        hit = torch.isin(tok, eos) if eos is not None else None
        texts = None
        if text is not None or want_chunks:
            row_list, tok_list, live = rows.tolist(), [[t] for t in tok.tolist()], unfinished.tolist()
        if text is not None:
            texts, stops, _ = text.push(row_list, tok_list, live)  # one token a row: kept whole
            if text.has_stop_strings:
                s = torch.tensor(stops, device=device)
                hit = s if hit is None else hit | s
        new_tokens += len(rows) if cfg.compact_finished else int(unfinished.sum())
        if step == 0:
            metrics.ttft_s = clock.lap("prefill")
        if want_chunks:
            still = (unfinished & ~hit if hit is not None else unfinished).tolist()
            tok_list = [t if alive else [] for t, alive in zip(tok_list, live)]
            with clock.paused():
                yield chunk_for(step, B, row_list, tok_list, [not s for s in still], texts)
        if hit is not None:
            unfinished = unfinished & ~hit
            if not bool(unfinished.any()):
                break
            if cfg.compact_finished and not bool(unfinished.all()):
                keep = unfinished.nonzero().squeeze(1)
                cache.reorder(keep)
                rows, tok, pos_ids, unfinished = rows[keep], tok[keep], pos_ids[keep], unfinished[keep]
                if seen is not None:
                    seen = seen[keep]
    clock.lap("decode")
    metrics.decode_s = clock.laps.get("decode", 0.0)
    metrics.steps = steps
    metrics.new_tokens = new_tokens
    metrics.finish(new_tokens - B)  # the first token of each row belongs to the prefill (TTFT)
    n = step + 1 if max_new else 0
    return out[:, :n]

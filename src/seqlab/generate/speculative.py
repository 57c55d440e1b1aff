"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a small draft proposes, the target verifies.

One round, per row, with the last generated token ``c`` not yet in either cache:

1. the draft, fed ``c``, proposes ``d_1..d_K``, each sampled from its *warped* distribution ``q_i`` (the same
   temperature / top-k / top-p / min-p chain as the target's), and we keep every ``q_i``;
2. the target runs once over ``[c, d_1..d_K]`` (K+1 positions in parallel, like a small prefill) giving
   ``p_1..p_{K+1}``;
3. ``d_i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``, left to right; at the first rejection
   the replacement is drawn from ``norm(max(0, p_i - q_i))``; if all K are accepted a bonus token is drawn from
   ``p_{K+1}``. Every round therefore yields between 1 and K+1 tokens, and the output is distributed exactly as
   sampling from the target alone;
4. both caches roll back (``cache.crop`` with a per-row length) to drop the rejected drafts.

Greedy is the special case where every distribution is a one-hot at its argmax: a draft is accepted iff it is
the target's argmax and the replacement is the target's argmax, so the tokens equal plain greedy decoding.

Batches: rows accept different numbers of drafts, so after a per-row ``crop`` the shorter rows leave invalid
"holes" in the cache that attention skips and positions ignore (see seqlab.model.cache). The cache is sized for
the worst case (K+1 slots per round). When every draft is accepted the draft never saw ``d_K``; the next round
feeds it ``[d_K, c]`` (left-padded to two tokens for the rows that need only ``c``).
Repetition penalty is not supported here (it would make ``p_i`` depend on the drafts in a way that the
acceptance rule does not model) and encoder-decoders are not supported; both raise a clear error.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from seqlab.eval import timing
from seqlab.generate.config import GenerationConfig
from seqlab.generate.engine import is_encoder_decoder, prefill
from seqlab.generate.metrics import GenerationMetrics
from seqlab.generate.request import Prepared, make_generator
from seqlab.generate.sampling import LogitsProcessor, sample_from
from seqlab.generate.text import StreamChunk, TextStream, chunk_for


def check_draft(target, draft, cfg: GenerationConfig) -> None:
    if is_encoder_decoder(target) or is_encoder_decoder(draft):
        raise ValueError("speculative decoding supports decoder-only target and draft models")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft vocab_size {draft.config.vocab_size} != target vocab_size "
                         f"{target.config.vocab_size}: draft and target must share the tokenizer")
    if cfg.repetition_penalty != 1.0:
        raise ValueError("GenerationConfig.repetition_penalty is not supported with speculative decoding")
    if cfg.num_beams > 1:
        raise ValueError("speculative decoding and beam search (num_beams > 1) cannot be combined")


def speculative_loop(target, draft, prep: Prepared, cfg: GenerationConfig, text: TextStream | None,
                     metrics: GenerationMetrics, want_chunks: bool,
                     clock: timing.Stopwatch | None = None) -> Iterator[StreamChunk]:
    """Generator (like the sampling loop): yields StreamChunks, returns new tokens [B, n]."""
    check_draft(target, draft, cfg)
    device = prep.input_ids.device
    B, T = prep.input_ids.shape
    K, max_new = cfg.num_speculative_tokens, cfg.max_new_tokens
    proc = LogitsProcessor(cfg.sampling())
    gen = make_generator(cfg, device)
    clock = clock or timing.Stopwatch(device)

    slots = T + max_new + K + 1 if B == 1 else T + (K + 1) * max_new + 1  # holes appear only when B > 1
    # positions skip the holes: a row reaches at most its prompt + max_new_tokens + the last round's look-ahead
    positions = int(prep.lengths.max()) + max_new + K
    for role, m in (("target", target), ("draft", draft)):
        if m.config.pos == "learned" and positions > m.config.max_seq_len:  # said before any work, with what to lower
            raise ValueError(f"speculative decoding of this request reaches {positions} positions (prompt "
                             f"{int(prep.lengths.max())}, max_new_tokens {max_new}, num_speculative_tokens {K}: a "
                             f"round looks {K} tokens ahead), past the {role}'s learned position table (max_seq_len="
                             f"{m.config.max_seq_len}); lower max_new_tokens or num_speculative_tokens, or decode "
                             "without the draft")
    t_cache = target.new_cache(B, slots, dtype=next(target.parameters()).dtype, device=device, positions=positions)
    d_cache = draft.new_cache(B, slots + 1, dtype=next(draft.parameters()).dtype, device=device, positions=positions)
    p0 = proc.probs(prefill(target, prep.input_ids, t_cache, prep.attention_mask, last_index=prep.last_index))
    prefill(draft, prep.input_ids, d_cache, prep.attention_mask, last_index=prep.last_index)
    metrics.kv_cache_bytes = t_cache.nbytes + d_cache.nbytes
    c = p0.argmax(-1) if proc.greedy else sample_from(p0, gen)

    out = torch.full((B, max_new), prep.pad, dtype=torch.long, device=device)
    gen_len = torch.zeros(B, dtype=torch.long, device=device)  # tokens written per original row
    rows = torch.arange(B, device=device)
    eos = torch.tensor(prep.eos, dtype=torch.long, device=device) if prep.eos else None
    extra = torch.full((B,), -1, dtype=torch.long, device=device)  # d_K the draft has not seen (-1: none)
    arangeK1 = torch.arange(K + 1, device=device)
    rounds = 0

    # the first token (from the prefill) is written like a one-token round
    block = torch.full((B, K + 1), prep.pad, dtype=torch.long, device=device)
    block[:, 0] = c
    n_tok = torch.ones(B, dtype=torch.long, device=device)
    while True:
        # ---- write this round's tokens, cut at EOS / stop strings / the token budget
        b = rows.shape[0]
        if eos is not None:
            is_eos = torch.isin(block, eos) & (arangeK1[None, :] < n_tok[:, None])
            first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, n_tok)
            n_tok = torch.minimum(n_tok, first_eos)
            done = is_eos.any(1)
        else:
            done = torch.zeros(b, dtype=torch.bool, device=device)
        room = max_new - gen_len[rows]
        n_tok = torch.minimum(n_tok, room)
        done |= n_tok >= room
        texts = None
        if text is not None or want_chunks:
            row_list = rows.tolist()
            tok_list = [block[i, :n].tolist() for i, n in enumerate(n_tok.tolist())]
        if text is not None:  # before the write: a stop string completed mid-round cuts the round there
            texts, stops, kept = text.push(row_list, tok_list)
            if text.has_stop_strings:
                done |= torch.tensor(stops, device=device)
                n_tok = torch.tensor(kept, dtype=torch.long, device=device)
                tok_list = [t[:k] for t, k in zip(tok_list, kept)]
        write = arangeK1[None, :] < n_tok[:, None]
        cols = (gen_len[rows][:, None] + arangeK1[None, :])[write]
        out[rows[:, None].expand(b, K + 1)[write], cols] = block[write]
        gen_len[rows] += n_tok
        if rounds == 0:
            metrics.ttft_s = clock.lap("prefill")
        if want_chunks:
            with clock.paused():
                yield chunk_for(rounds, B, row_list, tok_list, done.tolist(), texts)
        if bool(done.all()):
            break
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(1)
            t_cache.reorder(keep)
            d_cache.reorder(keep)
            rows, c, extra = rows[keep], c[keep], extra[keep]
        b = rows.shape[0]

        # ---- 1. draft K tokens
        d_start = d_cache.pos
        has_extra = extra >= 0
        if bool(has_extra.any()):
            ids = torch.stack([extra.clamp_min(0), c], dim=1)
            mask = torch.stack([has_extra, torch.ones_like(has_extra)], dim=1).long()
            width = 2
        else:
            ids, mask, width = c[:, None], None, 1
        drafts = torch.empty(b, K, dtype=torch.long, device=device)
        qs = torch.empty(b, K, target.config.vocab_size, device=device)
        for i in range(K):
            h = draft.body(ids, mask, cache=d_cache)
            q = proc.probs(draft.head(h[:, -1]))
            d = q.argmax(-1) if proc.greedy else sample_from(q, gen)
            qs[:, i], drafts[:, i] = q, d
            ids, mask = d[:, None], None

        # ---- 2. verify with the target: K+1 positions in one pass
        t_start = t_cache.pos
        verify = torch.cat([c[:, None], drafts], dim=1)
        p = proc.probs(target.head(target.body(verify, cache=t_cache)))  # [b, K+1, V]

        # ---- 3. accept / reject
        p_d = p[:, :K].gather(2, drafts[:, :, None]).squeeze(2)
        q_d = qs.gather(2, drafts[:, :, None]).squeeze(2)
        if proc.greedy:
            accept = p_d > 0.5  # one-hot p: the draft equals the target's argmax
        else:
            u = torch.rand(b, K, generator=gen, device=device)
            accept = u < p_d / q_d
        n_acc = accept.long().cumprod(dim=1).sum(dim=1)  # leading accepted drafts, 0..K
        q_pad = torch.cat([qs, torch.zeros(b, 1, qs.shape[2], device=device)], dim=1)  # q_{K+1} = 0 -> bonus from p
        idx = n_acc.view(b, 1, 1).expand(b, 1, p.shape[2])
        p_n, q_n = p.gather(1, idx).squeeze(1), q_pad.gather(1, idx).squeeze(1)
        residual = (p_n - q_n).clamp_min(0)
        mass = residual.sum(-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_n)  # mass 0 only if p == q
        c = residual.argmax(-1) if proc.greedy else sample_from(residual, gen)
        metrics.accepted_tokens += int(n_acc.sum())
        metrics.drafted_tokens += b * K
        rounds += 1

        # ---- 4. roll back both caches to the accepted prefix
        t_cache.crop(t_start + 1 + n_acc)
        d_cache.crop(d_start + width + n_acc.clamp(max=K - 1))
        extra = torch.where(n_acc == K, drafts[:, K - 1], torch.full_like(n_acc, -1))

        block = torch.cat([drafts, torch.zeros_like(c)[:, None]], dim=1)
        block.scatter_(1, n_acc[:, None], c[:, None])
        n_tok = n_acc + 1

    clock.lap("decode")
    metrics.decode_s = clock.laps.get("decode", 0.0)
    metrics.steps = rounds
    metrics.new_tokens = int(gen_len.sum())
    metrics.finish(metrics.new_tokens - B)
    return out[:, : int(gen_len.max())]

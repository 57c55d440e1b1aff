"""Beam search on the static KV cache (the same rules as Hugging Face ``generate(num_beams=K)``).

Per batch row we keep K running beams and K finished hypotheses. Each step:

1. every running beam's next-token log-probabilities are added to its accumulated log-probability (the
   repetition penalty, if any, is applied to the log-probabilities first, as HF does);
2. the best ``max(2, 1 + #EOS) * K`` continuations over all beams are taken (enough that K of them survive
   even if many end in EOS);
3. those that end in EOS, or reach ``max_new_tokens``, and rank within the first K become finished hypotheses
   with score ``sum_logprob / generated_len ** length_penalty`` -- ``generated_len`` counts the generated
   tokens only (EOS included), never the prompt;
4. the best K that did not finish become the running beams, and the cache rows are reordered to follow
   their parents (``cache.reorder``).

Stopping (``early_stopping``), per batch row:

* ``True``: stop once K hypotheses are finished.
* ``False`` (default): stop once the best running beam, scored at its *current* length, cannot beat the
  worst of K finished hypotheses (a heuristic: a longer continuation can still score higher when
  ``length_penalty > 0``).
* ``"never"``: the exact test -- with ``length_penalty > 0`` the best running beam is scored at the
  maximum length, an upper bound on anything it can still become, so nothing better is ever cut off.

With enough beams to hold every prefix this is exhaustive search (tests/generate/test_gen_beam.py checks it).
"""
from __future__ import annotations

import torch
from torch import Tensor

from seqlab.eval import timing
from seqlab.generate.config import GenerationConfig
from seqlab.generate.engine import step_fn
from seqlab.generate.metrics import GenerationMetrics
from seqlab.generate.request import Prepared, open_request, seen_tokens
from seqlab.generate.sampling import apply_repetition_penalty, mark_seen

NEG = -1.0e9


def _gather(x: Tensor, idx: Tensor) -> Tensor:
    """x [B, N, ...] gathered along dim 1 by idx [B, M] -> [B, M, ...]."""
    shape = idx.shape + x.shape[2:]
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(shape))


def beam_search(model, prep: Prepared, cfg: GenerationConfig, metrics: GenerationMetrics,
                clock: timing.Stopwatch | None = None) -> tuple[Tensor, Tensor]:
    """Returns (new tokens of the best hypothesis [B, n], its length-penalised score [B])."""
    device = prep.input_ids.device
    B = prep.input_ids.shape[0]
    K, V = cfg.num_beams, model.config.vocab_size
    max_new, lp, es = cfg.max_new_tokens, float(cfg.length_penalty), cfg.early_stopping
    eos = torch.tensor(prep.eos, dtype=torch.long, device=device) if prep.eos else None
    n_keep = max(2, 1 + len(prep.eos)) * K
    if n_keep > K * V:
        raise ValueError(f"num_beams={K} is too large for a vocabulary of {V} tokens")
    clock = clock or timing.Stopwatch(device)

    # Prefill the B prompts once, then copy each row's cache K times.
    cache, logits, pos_ids = open_request(model, prep, max_new)
    seen = seen_tokens(model, prep, cfg)
    expand = torch.arange(B, device=device).repeat_interleave(K)
    cache.reorder(expand)
    logits = logits.repeat_interleave(K, dim=0)
    pos_ids = pos_ids.repeat_interleave(K, dim=0)
    if seen is not None:
        seen = seen[expand].contiguous()
    metrics.kv_cache_bytes = cache.nbytes

    running_seq = torch.full((B, K, max_new), prep.pad, dtype=torch.long, device=device)
    running_score = torch.zeros(B, K, device=device)
    running_score[:, 1:] = NEG  # only beam 0 is live at first, so the K beams do not start as copies
    fin_seq = running_seq.clone()
    fin_score = torch.full((B, K), NEG, device=device)
    fin_done = torch.zeros(B, K, dtype=torch.bool, device=device)
    fin_len = torch.zeros(B, K, dtype=torch.long, device=device)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
    top_mask = torch.arange(n_keep, device=device) < K
    row_offset = torch.arange(B, device=device)[:, None] * K
    steps = 0
    step = step_fn(model, cfg.compile)

    for t in range(max_new):
        if t > 0:
            logits = step(next_tokens.view(-1), cache, pos_ids)
            pos_ids += 1
            steps += 1
        logp = torch.log_softmax(logits.float(), dim=-1)
        if seen is not None:
            logp = apply_repetition_penalty(logp, seen, cfg.repetition_penalty)
        cand = (running_score[:, :, None] + logp.view(B, K, V)).view(B, K * V)
        top_score, top_idx = cand.topk(n_keep, dim=1)  # [B, n_keep], sorted best first
        parent, token = top_idx // V, top_idx % V
        cand_seq = _gather(running_seq, parent)
        cand_seq[:, :, t] = token
        hits = torch.isin(token, eos) if eos is not None else torch.zeros_like(token, dtype=torch.bool)
        if t == max_new - 1:
            hits = torch.ones_like(hits)

        # running beams for the next step: the best K continuations that did not finish
        run_score = top_score + hits.float() * NEG
        nxt = run_score.topk(K, dim=1).indices
        running_seq = _gather(cand_seq, nxt)
        running_score = run_score.gather(1, nxt)
        next_tokens = token.gather(1, nxt)
        beam_parent = parent.gather(1, nxt)

        # finished hypotheses: merge the newly finished (within the top K ranks) and keep the best K
        norm = top_score / float(t + 1) ** lp
        blocked = ~improvable
        if es is True:
            blocked = blocked | fin_done.all(dim=1, keepdim=True)
        just = hits & top_mask[None, :]
        norm = norm + blocked.float() * NEG + (~just).float() * NEG
        m_score = torch.cat([fin_score, norm], dim=1)
        best = m_score.topk(K, dim=1).indices
        fin_seq = _gather(torch.cat([fin_seq, cand_seq], dim=1), best)
        fin_score = m_score.gather(1, best)
        fin_done = torch.cat([fin_done, just & ~blocked], dim=1).gather(1, best)
        fin_len = torch.cat([fin_len, torch.full_like(token, t + 1)], dim=1).gather(1, best)

        if t == 0:
            metrics.ttft_s = clock.lap("prefill")
        if bool(hits.all()):
            break
        src = (beam_parent + row_offset).view(-1)
        cache.reorder(src)
        if seen is not None:
            seen = seen[src]
            mark_seen(seen, next_tokens.view(-1))

        best_len = max_new if (es == "never" and lp > 0) else t + 1
        best_running = running_score[:, :1] / float(best_len) ** lp
        worst_fin = torch.where(fin_done.all(dim=1, keepdim=True), fin_score.min(dim=1, keepdim=True).values,
                                torch.full_like(best_running, NEG))
        improvable = improvable & (best_running > worst_fin)
        if not bool(improvable.any()) or (es is True and bool(fin_done.all())):
            break

    clock.lap("decode")
    metrics.decode_s = clock.laps.get("decode", 0.0)
    metrics.steps = steps
    n = int(fin_len[:, 0].max())
    metrics.new_tokens = int(fin_len[:, 0].sum())
    metrics.finish(max(metrics.new_tokens - B, 0))  # the returned tokens after each row's first, as elsewhere
    return fin_seq[:, 0, :n], fin_score[:, 0]

"""Batched autoregressive sampling with unique prefixes and counts, on the decoder's KV cache.

Instead of drawing N_s sequences one by one, the sampler walks the tree of prefixes once (NNQS-Transformer,
QiankunNet, NAQS): each unique prefix carries how many of the N_s samples pass through it; at orbital i its
count is split multinomially over the four pair tokens by P(t_i | prefix), zero counts are dropped, and the
surviving (prefix, token) pairs become the next level. N_s can be 10^12 at no extra cost: the work is proportional
to the number of *unique* prefixes. The output is the set of unique configurations with their counts.

KV cache: the decoder reads a prefix one token at a time (``generate.engine.prefill`` for BOS, then
``decode_step``), exactly like text generation. When prefixes branch, each child gets a copy of its parent's
keys/values, so nothing is recomputed. The copy is taken only when a level is about to be decoded (a level carries
its parent's cache and the parent rows it needs, ``_level_cache``): leaves and forced tails are never decoded, and
on C2's sector tree the copies they skip were half the walk's time (docs/nnqs.md, "Speed"). ``use_cache=False``
re-runs the whole prefix at every orbital, for comparison (bench/nnqs_speed.py) and as a correctness check (the
probabilities must agree).

Memory: when the number of unique prefixes exceeds ``max_batch``, the level is cut into chunks that are finished
depth-first, one after the other, so at most about ``max_batch`` rows (and their caches) are alive per level.

Distributed: every rank walks the same top of the tree with the same seed until there are at least
``split_rows_per_rank * world_size`` prefixes; then the prefixes are cut into ``world_size`` contiguous groups of
about equal count and each rank finishes only its own group with its own random stream. Together the ranks hold
exactly one sample tree of N_s samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seqlab.generate.engine import decode_step, prefill
from seqlab.nnqs.ansatz import BOS, Wavefunction
from seqlab.nnqs.space import valid_token_mask


@dataclass
class SamplerConfig:
    use_cache: bool = True
    max_batch: int = 65536  # unique prefixes processed together before the level is chunked
    split_rows_per_rank: int = 8  # distributed: shared prefix tree until this many prefixes per rank

    def __post_init__(self) -> None:
        for name in ("max_batch", "split_rows_per_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"SamplerConfig.{name}: must be >= 1, got {getattr(self, name)}")


@dataclass
class Samples:
    tokens: Tensor  # [U, n_orb] int64 unique configurations (this rank's share)
    counts: Tensor  # [U] int64, summing to this rank's share of N_s
    n_total: int  # N_s over all ranks


@dataclass
class _Level:
    prefix: Tensor  # [U, i]
    counts: Tensor  # [U] float64 (exact integers up to 2^53)
    cache: object | None  # the parent level's KV cache (the root's own)
    shared: bool  # still identical on every rank
    cache_rows: Tensor | None = None  # rows of ``cache`` that are this level's prefixes; None: all, in order


def multinomial_split(counts: Tensor, probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """Split each row's count over the 4 tokens: a multinomial draw built from chained binomials.

    The last token with nonzero probability takes whatever remains, so round-off in the conditional probabilities
    can never push a count onto a masked (invalid) token.
    """
    U, K = probs.shape
    out = torch.zeros(U, K, dtype=torch.float64, device=counts.device)
    remaining = counts.clone()
    mass = torch.ones(U, dtype=torch.float64, device=counts.device)
    k_idx = torch.arange(K, device=counts.device)
    last = torch.where(probs > 0, k_idx, -1).max(dim=1).values
    for k in range(K):
        pk = probs[:, k]
        q = torch.where(mass > 0, pk / mass.clamp_min(1e-300), torch.zeros_like(pk)).clamp(0.0, 1.0)
        q = torch.where(last == k, torch.ones_like(q), q)
        q = torch.where(last < k, torch.zeros_like(q), q)
        nk = torch.binomial(remaining, q, generator=generator) if bool((remaining > 0).any()) else remaining * 0
        nk = torch.minimum(nk, remaining)
        out[:, k] = nk
        remaining = remaining - nk
        mass = mass - pk
    return out


def _take_rows(level: _Level, rows: Tensor, shared: bool) -> _Level:
    return _Level(level.prefix[rows], level.counts[rows], level.cache, shared, _compose(level.cache_rows, rows))


def _compose(cache_rows: Tensor | None, rows: Tensor) -> Tensor:
    """Rows ``rows`` of a level whose prefixes are rows ``cache_rows`` of its cache (None: all, in order)."""
    return rows if cache_rows is None else cache_rows[rows]


def _level_cache(cache, cache_rows: Tensor | None):
    """The KV cache of a level about to be decoded: ``cache`` itself when its rows are the level's, else a copy of
    the level's rows (the parent stays intact for its other chunks)."""
    return cache if cache_rows is None else cache.select(cache_rows)


def _rank_groups(counts: Tensor, world_size: int) -> Tensor:
    """Contiguous groups of roughly equal total count: group id per row."""
    mid = torch.cumsum(counts, 0) - 0.5 * counts
    return (mid / counts.sum() * world_size).floor().long().clamp(0, world_size - 1)


@torch.no_grad()
def sample(
    wf: Wavefunction,
    n_samples: int,
    generator: torch.Generator | None = None,
    cfg: SamplerConfig | None = None,
    rank: int = 0,
    world_size: int = 1,
    local_generator: torch.Generator | None = None,
) -> Samples:
    """Draw ``n_samples`` configurations from P(x); returns unique configurations with counts (this rank's share).

    ``generator`` must be seeded identically on all ranks; ``local_generator`` (distinct per rank) drives the part
    of the tree each rank finishes alone.
    """
    cfg = cfg or SamplerConfig()
    if n_samples < 1 or n_samples > 2**53:
        raise ValueError(f"n_samples must be in [1, 2^53], got {n_samples}")
    if world_size > 1 and local_generator is None:
        raise ValueError("distributed sampling needs a per-rank local_generator")
    dev = next(wf.parameters()).device
    n = wf.n_orb
    dec = wf.decoder
    counts0 = torch.tensor([float(n_samples)], dtype=torch.float64, device=dev)
    cache0 = dec.new_cache(1, n) if cfg.use_cache else None
    stack = [_Level(torch.zeros(1, 0, dtype=torch.long, device=dev), counts0, cache0, world_size > 1)]
    done_tokens, done_counts = [], []
    while stack:
        lv = stack.pop()
        if lv.prefix.shape[0] == 0:  # this rank's share is empty
            continue
        i = lv.prefix.shape[1]
        if i == n:
            if lv.shared:  # the tree never got wide enough to split early: split the leaves
                lv = _take_rows(lv, torch.nonzero(_rank_groups(lv.counts, world_size) == rank).flatten(), False)
            done_tokens.append(lv.prefix)
            done_counts.append(lv.counts)
            continue
        U = lv.prefix.shape[0]
        cache = _level_cache(lv.cache, lv.cache_rows) if cfg.use_cache else None
        if cfg.use_cache:
            if i == 0:
                logits = prefill(dec, torch.full((U, 1), BOS, dtype=torch.long, device=dev), cache)
            else:
                logits = decode_step(dec, lv.prefix[:, -1], cache)
        else:
            ids = torch.cat((torch.full((U, 1), BOS, dtype=torch.long, device=dev), lv.prefix), 1)
            logits = dec(ids)[:, -1]
        n_a = (lv.prefix & 1).sum(1)
        n_b = (lv.prefix >> 1).sum(1)
        logp = wf.masked_log_probs(logits, wf.n_alpha - n_a, wf.n_beta - n_b, n - i)
        gen = generator if lv.shared or world_size == 1 else local_generator
        split = multinomial_split(lv.counts, logp.double().exp(), gen)
        row, tok = torch.nonzero(split, as_tuple=True)
        nxt = _Level(torch.cat((lv.prefix[row], tok[:, None]), 1), split[row, tok], cache, lv.shared, row)
        if nxt.shared and len(row) >= cfg.split_rows_per_rank * world_size and i + 1 < n:
            nxt = _take_rows(nxt, torch.nonzero(_rank_groups(nxt.counts, world_size) == rank).flatten(), False)
        if len(nxt.counts) > cfg.max_batch and not nxt.shared:
            chunks = torch.arange(len(nxt.counts), device=dev).split(cfg.max_batch)
            stack.extend(_take_rows(nxt, c, False) for c in reversed(chunks))
        else:
            stack.append(nxt)
    tokens = torch.cat(done_tokens) if done_tokens else torch.zeros(0, n, dtype=torch.long, device=dev)
    counts = torch.cat(done_counts) if done_counts else torch.zeros(0, dtype=torch.float64, device=dev)
    return Samples(tokens, counts.round().long(), n_samples)


def forced_completion(prefix: Tensor, n_alpha: int, n_beta: int, n_orb: int) -> Tensor | None:
    """Which prefixes have only one valid completion, [U] bool, or None when none has.

    A prefix is forced when each spin's remaining electrons are 0 or exactly the orbitals left: every later token
    is then fixed (``complete_forced``) with conditional probability 1, so the network need not see it. In the
    sector tree of N2 (STO-3G) two thirds of all prefix rows are such forced tails.
    """
    left = n_orb - prefix.shape[1]
    alpha_left, beta_left = n_alpha - (prefix & 1).sum(1), n_beta - (prefix >> 1).sum(1)
    forced = ((alpha_left == 0) | (alpha_left == left)) & ((beta_left == 0) | (beta_left == left))
    return forced if bool(forced.any()) else None


def complete_forced(prefix: Tensor, n_alpha: int, n_beta: int, n_orb: int) -> Tensor:
    """Forced prefixes [U, i] -> their only valid configurations [U, n_orb] (see ``forced_completion``)."""
    alpha_left, beta_left = n_alpha - (prefix & 1).sum(1), n_beta - (prefix >> 1).sum(1)
    token = (alpha_left > 0).long() + 2 * (beta_left > 0).long()
    return torch.cat((prefix, token[:, None].expand(-1, n_orb - prefix.shape[1])), 1)


def _next_conditionals(wf: Wavefunction, prefix: Tensor, cache) -> tuple[Tensor, Tensor, Tensor]:
    """log P(t_i | prefix) [U, 4] of the next orbital, masked to valid tokens, from the prefixes' last token on the
    KV cache (BOS at the root); and each prefix's electrons left per spin [U]. The tree walks' common step."""
    i = prefix.shape[1]
    if i == 0:
        bos = torch.full((len(prefix), 1), BOS, dtype=torch.long, device=prefix.device)
        logits = prefill(wf.decoder, bos, cache)
    else:
        logits = decode_step(wf.decoder, prefix[:, -1], cache)
    alpha_left, beta_left = wf.n_alpha - (prefix & 1).sum(1), wf.n_beta - (prefix >> 1).sum(1)
    return wf.masked_log_probs(logits, alpha_left, beta_left, wf.n_orb - i), alpha_left, beta_left


@torch.no_grad()
def enumerate_log_prob(wf: Wavefunction, max_batch: int = 65536) -> tuple[Tensor, Tensor]:
    """Every valid configuration [D, n_orb] and its log P [D] (float32), by walking the *whole* prefix tree.

    The sector fast path of exact local energies needs psi on every configuration each step. Walking the tree like
    ``sample`` (every valid child kept instead of a multinomial split) reads each shared prefix once on the KV
    cache, several times cheaper than one parallel forward over the finished configurations. Prefixes with a single
    valid completion are finished at once without the network (``forced_completion``: 3x fewer rows for N2).
    Levels wider than ``max_batch`` are finished depth-first in chunks (bounded memory). Rows come out in tree
    order, not by key.
    """
    dev = next(wf.parameters()).device
    n, dec = wf.n_orb, wf.decoder
    # (prefixes [U, i], their log P [U], the parent's KV cache, the prefixes' rows in it: see ``_level_cache``)
    stack = [(torch.zeros(1, 0, dtype=torch.long, device=dev), torch.zeros(1, device=dev), dec.new_cache(1, n), None)]
    done_tokens, done_lp = [], []
    while stack:
        prefix, lp, cache, cache_rows = stack.pop()
        i = prefix.shape[1]
        forced = forced_completion(prefix, wf.n_alpha, wf.n_beta, n) if i < n else None
        if forced is not None:  # finished without the network: every later conditional is 1
            done_tokens.append(complete_forced(prefix[forced], wf.n_alpha, wf.n_beta, n))
            done_lp.append(lp[forced])
            if bool(forced.all()):
                continue
            rows = torch.nonzero(~forced).flatten()
            prefix, lp, cache_rows = prefix[rows], lp[rows], _compose(cache_rows, rows)
        if i == n:
            done_tokens.append(prefix)
            done_lp.append(lp)
            continue
        cache = _level_cache(cache, cache_rows)
        cond, alpha_left, beta_left = _next_conditionals(wf, prefix, cache)
        row, tok = torch.nonzero(valid_token_mask(alpha_left, beta_left, n - i), as_tuple=True)
        nxt_prefix, nxt_lp = torch.cat((prefix[row], tok[:, None]), 1), lp[row] + cond[row, tok]
        if len(row) > max_batch:
            stack.extend((nxt_prefix[c], nxt_lp[c], cache, row[c])
                         for c in reversed(torch.arange(len(row), device=dev).split(max_batch)))
        else:
            stack.append((nxt_prefix, nxt_lp, cache, row))
    return torch.cat(done_tokens), torch.cat(done_lp)


@torch.no_grad()
def tree_log_prob(wf: Wavefunction, tokens: Tensor, max_batch: int = 65536) -> Tensor:
    """log P [M] (float32) of given valid configurations [M, n_orb], walking only *their* prefix tree.

    Outside the sector fast path the exact local energy needs psi on the configurations connected to the samples:
    ~10^5-10^6 of them for a 26-spin-orbital molecule, which share long prefixes (the low orbitals stay doubly
    occupied). Each unique prefix is read once on the KV cache, as in ``enumerate_log_prob``, instead of every
    configuration running the full sequence; forced tails are finished without the network. Wide levels are
    finished depth-first in chunks of ``max_batch`` prefixes (bounded memory). Rows come back in ``tokens``' order.
    """
    dev = next(wf.parameters()).device
    n, dec = wf.n_orb, wf.decoder
    tokens = tokens.to(device=dev, dtype=torch.long)
    out = torch.empty(len(tokens), device=dev)
    # (prefixes [U, i], their log P [U], the parent's KV cache, the prefixes' rows in it (``_level_cache``),
    # members: rows of `tokens` [R] and the prefix each is under [R])
    stack = [(torch.zeros(1, 0, dtype=torch.long, device=dev), torch.zeros(1, device=dev), dec.new_cache(1, n), None,
              torch.arange(len(tokens), device=dev), torch.zeros(len(tokens), dtype=torch.long, device=dev))]
    while stack and len(tokens):
        prefix, lp, cache, cache_rows, rows, owner = stack.pop()
        i = prefix.shape[1]
        forced = forced_completion(prefix, wf.n_alpha, wf.n_beta, n) if i < n else None
        if i == n or (forced is not None and bool(forced.all())):
            out[rows] = lp[owner]
            continue
        if forced is not None:  # members under a forced prefix are its only completion: their log P is the prefix's
            done = forced[owner]
            out[rows[done]] = lp[owner[done]]
            keep = torch.nonzero(~forced).flatten()
            new_index = torch.cumsum(~forced, 0) - 1
            prefix, lp, rows, owner = prefix[keep], lp[keep], rows[~done], new_index[owner[~done]]
            cache_rows = _compose(cache_rows, keep)
        cache = _level_cache(cache, cache_rows)
        cond = _next_conditionals(wf, prefix, cache)[0]
        child, owner = torch.unique(owner * 4 + tokens[rows, i], return_inverse=True)  # sorted: parents in order
        parent, tok = child // 4, child % 4
        nxt_prefix, nxt_lp = torch.cat((prefix[parent], tok[:, None]), 1), lp[parent] + cond[parent, tok]
        if len(child) <= max_batch:
            stack.append((nxt_prefix, nxt_lp, cache, parent, rows, owner))
            continue
        for c in reversed(torch.arange(len(child), device=dev).split(max_batch)):  # each chunk copies only its rows
            lo, hi = int(c[0]), int(c[-1]) + 1
            mine = (owner >= lo) & (owner < hi)
            stack.append((nxt_prefix[c], nxt_lp[c], cache, parent[c], rows[mine], owner[mine] - lo))
    return out

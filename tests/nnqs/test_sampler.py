"""The ansatz as a probability distribution, and the unique-prefix sampler drawing from it."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from seqlab.generate.engine import decode_step, prefill
from seqlab.nnqs.ansatz import BOS, AnsatzConfig, Wavefunction
from seqlab.nnqs.sampler import SamplerConfig, multinomial_split, sample, tree_log_prob
from seqlab.nnqs.space import all_configurations, keys_to_tokens, tokens_to_keys
from seqlab.nnqs.vmc import make_evaluator

SMALL = AnsatzConfig(d_model=32, n_layers=2, n_heads=4, phase_hidden=16)


def random_wf(n_orb: int, na: int, nb: int, seed: int = 0, sharpen: float = 8.0) -> Wavefunction:
    """A random ansatz whose P is far from uniform (scaled-up weights), so that tests can tell distributions apart."""
    torch.manual_seed(seed)
    wf = Wavefunction(n_orb, na, nb, SMALL)
    with torch.no_grad():
        for p in wf.decoder.parameters():
            if p.dim() == 2:
                p.mul_(sharpen)
    return wf.eval()


@pytest.mark.parametrize("n_orb,na,nb", [(6, 2, 2), (5, 3, 1), (4, 0, 2), (4, 4, 4)])
def test_probabilities_sum_to_one_over_valid_configurations(n_orb, na, nb):
    wf = random_wf(n_orb, na, nb)
    with torch.no_grad():
        p = wf.log_prob(all_configurations(n_orb, na, nb)).double().exp()
        assert abs(p.sum().item() - 1.0) < 1e-6
        # a configuration with the wrong electron count has probability exactly zero
        bad = torch.full((1, n_orb), 3 if na < n_orb or nb < n_orb else 0)
        if na != n_orb or nb != n_orb:
            assert wf.log_prob(bad).item() == float("-inf")


def test_samples_conserve_electrons_and_counts_sum_to_ns():
    wf = random_wf(8, 3, 2, sharpen=1.0)
    s = sample(wf, 10**9, torch.Generator().manual_seed(0))
    assert s.counts.sum().item() == 10**9 and bool((s.counts > 0).all())
    assert bool(((s.tokens & 1).sum(1) == 3).all()) and bool(((s.tokens >> 1).sum(1) == 2).all())
    assert len(torch.unique(tokens_to_keys(s.tokens))) == len(s.tokens)  # configurations are unique
    assert len(s.tokens) > 100  # a near-uniform P over 1568 configurations: many distinct samples


def _chi2_pvalue(wf, s) -> float:
    allc = all_configurations(wf.n_orb, wf.n_alpha, wf.n_beta)
    with torch.no_grad():
        p = wf.log_prob(allc).double().exp()
    idx = torch.searchsorted(tokens_to_keys(allc), tokens_to_keys(s.tokens))
    obs = torch.zeros(len(allc), dtype=torch.float64)
    obs[idx] = s.counts.double()
    exp = p / p.sum() * s.n_total
    # pool the rare configurations so every cell expects >= 5 (the chi-square approximation needs it)
    rare = exp < 5
    o, e = obs[~rare], exp[~rare]
    if bool(rare.any()):
        o, e = torch.cat((o, obs[rare].sum().reshape(1))), torch.cat((e, exp[rare].sum().reshape(1)))
    return float(chisquare(o.numpy(), e.numpy()).pvalue)


@pytest.mark.parametrize("use_cache,max_batch", [(True, 65536), (False, 65536), (True, 3)])
def test_empirical_frequencies_match_p(use_cache, max_batch):
    wf = random_wf(5, 2, 2, seed=1)
    s = sample(wf, 20_000, torch.Generator().manual_seed(3), SamplerConfig(use_cache=use_cache, max_batch=max_batch))
    assert s.counts.sum().item() == 20_000
    assert _chi2_pvalue(wf, s) > 1e-3


def test_chi_square_rejects_a_different_distribution():
    """The chi-square check has teeth: samples of one ansatz do not pass as samples of another."""
    s = sample(random_wf(5, 2, 2, seed=1), 20_000, torch.Generator().manual_seed(3))
    assert _chi2_pvalue(random_wf(5, 2, 2, seed=2), s) < 1e-6


def test_kv_cache_probabilities_match_recomputation():
    """log P(x) decoded one orbital at a time on the KV cache == one parallel pass without cache (< 1e-6)."""
    wf = random_wf(7, 3, 3, seed=4, sharpen=2.0)
    x = all_configurations(7, 3, 3)[torch.randperm(1225)[:300]]
    with torch.no_grad():
        full = wf.conditional_log_probs(x)
        cache = wf.decoder.new_cache(len(x), 7)
        logits = prefill(wf.decoder, torch.full((len(x), 1), BOS), cache)
        steps = []
        for i in range(7):
            na = (x[:, :i] & 1).sum(1)
            nb = (x[:, :i] >> 1).sum(1)
            steps.append(wf.masked_log_probs(logits, 3 - na, 3 - nb, 7 - i))
            if i < 6:
                logits = decode_step(wf.decoder, x[:, i], cache)
        cached = torch.stack(steps, 1)
    finite = torch.isfinite(full)
    assert torch.equal(finite, torch.isfinite(cached))
    assert (full[finite] - cached[finite]).abs().max().item() < 1e-6
    lp_full = full.gather(-1, x[..., None]).sum((1, 2))
    lp_cache = cached.gather(-1, x[..., None]).sum((1, 2))
    assert (lp_full.exp() - lp_cache.exp()).abs().max().item() < 1e-6


def test_sampler_with_and_without_cache_draw_the_same_tree():
    """Same seed, same tree: the two paths' probabilities differ only by float32 round-off, which can move a binomial
    draw by a count or two, never more."""
    wf = random_wf(6, 2, 3, seed=5)
    a = sample(wf, 10**6, torch.Generator().manual_seed(9), SamplerConfig(use_cache=True))
    b = sample(wf, 10**6, torch.Generator().manual_seed(9), SamplerConfig(use_cache=False))
    oa, ob = torch.argsort(tokens_to_keys(a.tokens)), torch.argsort(tokens_to_keys(b.tokens))
    assert torch.equal(a.tokens[oa], b.tokens[ob])
    assert (a.counts[oa] - b.counts[ob]).abs().sum().item() <= 10


def test_distributed_split_partitions_one_sample_tree():
    """Two 'ranks' with the same shared seed hold disjoint parts of one tree whose counts sum to N_s."""
    wf = random_wf(6, 3, 3, seed=6, sharpen=1.0)
    parts = [sample(wf, 10**6, torch.Generator().manual_seed(1), SamplerConfig(split_rows_per_rank=2), rank=r,
                    world_size=2, local_generator=torch.Generator().manual_seed(100 + r)) for r in range(2)]
    assert sum(p.counts.sum().item() for p in parts) == 10**6
    k0, k1 = (set(tokens_to_keys(p.tokens).tolist()) for p in parts)
    assert k0 and k1 and not (k0 & k1)
    merged = type(parts[0])(torch.cat([p.tokens for p in parts]), torch.cat([p.counts for p in parts]), 10**6)
    assert _chi2_pvalue(wf, merged) > 1e-3


def test_multinomial_split_never_assigns_masked_tokens():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    probs[0, 1] += 1e-15  # round-off must not leak counts onto masked tokens
    counts = torch.tensor([1e12, 5.0, 4e3], dtype=torch.float64)
    out = multinomial_split(counts, probs, g)
    assert torch.equal(out.sum(1), counts)
    assert out[0, 2:].sum() == 0 and out[1, :3].sum() == 0
    assert abs(out[0, 0].item() / 1e12 - 0.3) < 1e-4


@pytest.mark.parametrize("max_batch", [65536, 5])
@pytest.mark.parametrize("n_orb,na,nb", [(8, 3, 3), (6, 5, 1), (5, 0, 2)])
def test_tree_log_prob_of_a_subset_equals_the_forward(n_orb, na, nb, max_batch):
    """log P on the subset's own prefix tree (KV cache, forced tails, chunked levels) equals one forward per
    configuration, in the caller's row order, duplicates included."""
    wf = random_wf(n_orb, na, nb)
    allc = all_configurations(n_orb, na, nb)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(len(allc), (max(3, len(allc) // 3),), generator=g)  # unsorted, with repeats
    got = tree_log_prob(wf, allc[rows], max_batch=max_batch)
    with torch.no_grad():
        ref = wf.log_prob(allc[rows])
    assert got.shape == ref.shape and torch.isfinite(got).all()
    assert (got - ref).abs().max() < 1e-4
    assert tree_log_prob(wf, allc[:0]).shape == (0,)


def test_evaluator_gives_log_psi_of_the_forward():
    wf = random_wf(7, 3, 2)
    tokens = all_configurations(7, 3, 2)
    got = make_evaluator(wf, batch=16)(tokens_to_keys(tokens))
    assert got.dtype == torch.complex128
    assert (got - wf.log_psi(keys_to_tokens(tokens_to_keys(tokens), 7))).abs().max() < 1e-4

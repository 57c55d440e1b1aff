"""Logits processors against the exact warped distribution (chi-square), boundary/tie rules, HF, errors.

The reference distributions here are written out independently in numpy float64 from the rules in
``seqlab.generate.sampling``'s docstring; nothing is computed by the code under test.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from seqlab.generate.sampling import (
    LogitsProcessor,
    SamplingParams,
    min_p_filter,
    seen_mask,
    top_k_filter,
    top_p_filter,
)

LOGITS = np.array([2.0, 1.5, 1.0, 0.4, 0.0, -0.5, -1.5, -3.0])  # V = 8, no ties
N_DRAWS = 40_000


def reference(logits: np.ndarray, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, keep=1) -> np.ndarray:
    """The documented warp, from scratch: temperature -> top-k -> top-p -> min-p -> renormalise."""
    z = logits / temperature
    alive = np.ones_like(z, dtype=bool)

    def probs():
        e = np.where(alive, np.exp(z - z[alive].max()), 0.0)
        return e / e.sum()

    if top_k:
        kth = np.sort(z[alive])[::-1][max(top_k, keep) - 1]
        alive &= z >= kth
    if top_p < 1.0:
        p = probs()
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        n = max(int((before < top_p - 1e-9).sum()), keep)
        alive &= p >= p[order][n - 1]
    if min_p > 0.0:
        p = probs()
        alive &= p >= min_p * p.max()
    return probs()


def draw(params: SamplingParams, logits: np.ndarray, n: int = N_DRAWS, seed: int = 0) -> np.ndarray:
    proc = LogitsProcessor(params)
    g = torch.Generator().manual_seed(seed)
    rows = torch.tensor(logits, dtype=torch.float32).expand(n, -1)
    tokens = proc.select(rows, generator=g)
    return np.bincount(tokens.numpy(), minlength=len(logits))


def assert_matches(counts: np.ndarray, p: np.ndarray) -> None:
    """Removed tokens never drawn; the kept ones pass a chi-square goodness-of-fit test."""
    assert counts[p == 0].sum() == 0, f"drew filtered tokens: {counts} vs {p}"
    kept = p > 0
    if kept.sum() == 1:
        assert counts[kept].sum() == counts.sum()
        return
    expected = p[kept] * counts.sum()
    pval = stats.chisquare(counts[kept], expected).pvalue
    assert pval > 1e-3, f"chi-square p={pval:.2e}: counts {counts}, expected {expected.round(1)}"


CASES = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.7),
    dict(temperature=1.0, top_k=3),
    dict(temperature=0.8, top_k=5),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=1.2, top_k=6, top_p=0.85, min_p=0.1),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_sampled_frequencies_match_exact_warped_distribution(case):
    counts = draw(SamplingParams(**case), LOGITS)
    assert_matches(counts, reference(LOGITS, **case))


def test_chi_square_has_power():
    """The check above would notice a wrong temperature or a missing filter (the test can fail)."""
    counts = draw(SamplingParams(temperature=1.0), LOGITS)
    p_wrong = reference(LOGITS, temperature=1.2)
    expected = p_wrong * counts.sum()
    assert stats.chisquare(counts, expected).pvalue < 1e-6
    counts = draw(SamplingParams(temperature=1.0, top_p=0.9), LOGITS)
    assert counts[reference(LOGITS, top_p=0.9) == 0].sum() == 0
    assert draw(SamplingParams(temperature=1.0), LOGITS)[-1] > 0  # unfiltered: the tail does get drawn


def kept(filtered: torch.Tensor) -> list[int]:
    return torch.isfinite(filtered[0]).nonzero().flatten().tolist()


def logits_of(p):
    return torch.log(torch.tensor([p], dtype=torch.float32))


def test_top_p_threshold_exact_and_min_tokens():
    z = logits_of([0.5, 0.3, 0.2])
    assert kept(top_p_filter(z, 0.8)) == [0, 1]  # mass reaches 0.8 exactly with two tokens: stop there
    assert kept(top_p_filter(z, 0.8001)) == [0, 1, 2]
    assert kept(top_p_filter(z, 0.5)) == [0]
    assert kept(top_p_filter(z, 0.5001)) == [0, 1]
    assert kept(top_p_filter(z, 0.1)) == [0]
    assert kept(top_p_filter(z, 0.1, min_tokens_to_keep=2)) == [0, 1]
    assert kept(top_p_filter(z, 1.0)) == [0, 1, 2]


def test_top_p_and_top_k_keep_ties():
    z = logits_of([0.4, 0.2, 0.2, 0.2])
    assert kept(top_p_filter(z, 0.5)) == [0, 1, 2, 3]  # 0.4 + first 0.2 reaches; the tied 0.2s come along
    assert kept(top_p_filter(z, 0.4)) == [0]
    assert kept(top_k_filter(z, 2)) == [0, 1, 2, 3]
    assert kept(top_k_filter(z, 1)) == [0]
    z = logits_of([0.2, 0.4, 0.2, 0.2])  # order of the ties does not matter
    assert kept(top_p_filter(z, 0.5)) == [0, 1, 2, 3]


def test_min_p_threshold():
    z = logits_of([0.5, 0.25, 0.15, 0.1])
    assert kept(min_p_filter(z, 0.5)) == [0, 1]  # 0.25 == 0.5 * 0.5 is kept (>=)
    assert kept(min_p_filter(z, 0.3)) == [0, 1, 2]
    assert kept(min_p_filter(z, 1.0)) == [0]
    assert kept(min_p_filter(z, 1.0, min_tokens_to_keep=3)) == [0, 1, 2]


def test_greedy_is_argmax_with_lowest_index_on_ties():
    z = torch.tensor([[0.1, 3.0, 3.0, -1.0], [5.0, 0.0, 5.0, 1.0]])
    for params in (SamplingParams(temperature=0.0), SamplingParams(do_sample=False, temperature=0.3, top_k=1)):
        assert LogitsProcessor(params).select(z).tolist() == [1, 0]
        probs = LogitsProcessor(params).probs(z)
        assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_seeded_sampling_is_reproducible():
    p = SamplingParams(temperature=1.0, top_k=5)
    assert (draw(p, LOGITS, 500, seed=3) == draw(p, LOGITS, 500, seed=3)).all()
    proc = LogitsProcessor(p)
    z = torch.tensor(LOGITS, dtype=torch.float32).expand(64, -1)
    a = proc.select(z, generator=torch.Generator().manual_seed(1))
    b = proc.select(z, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(a, b)


def test_repetition_penalty_and_seen_mask():
    ids = torch.tensor([[9, 9, 1, 2], [3, 4, 4, 0]])  # row 0 left-padded with 9 (pad) twice
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    seen = seen_mask(ids, mask, vocab_size=10)
    assert seen[0].nonzero().flatten().tolist() == [1, 2]
    assert seen[1].nonzero().flatten().tolist() == [0, 3, 4]
    z = torch.tensor([[1.0, 2.0, -2.0, 0.5, 0.0, 0, 0, 0, 0, 3.0]] * 2)
    out = LogitsProcessor(SamplingParams(repetition_penalty=2.0, do_sample=False)).penalise(z, seen)
    assert out[0].tolist() == [1.0, 1.0, -4.0, 0.5, 0.0, 0, 0, 0, 0, 3.0]
    assert out[1].tolist() == [0.5, 2.0, -2.0, 0.25, 0.0, 0, 0, 0, 0, 3.0]


def test_agrees_with_hugging_face_warpers():
    tf = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(0)
    z = torch.randn(16, 50, generator=g) * 3
    ids = torch.randint(0, 50, (16, 7), generator=g)
    hf = tf.generation.logits_process
    cases = [
        (SamplingParams(temperature=0.7, top_k=10), [hf.TemperatureLogitsWarper(0.7), hf.TopKLogitsWarper(10)]),
        (SamplingParams(top_p=0.63), [hf.TopPLogitsWarper(0.63)]),
        (SamplingParams(top_p=0.3, min_tokens_to_keep=4), [hf.TopPLogitsWarper(0.3, min_tokens_to_keep=4)]),
        (SamplingParams(min_p=0.15), [hf.MinPLogitsWarper(0.15)]),
        (SamplingParams(repetition_penalty=1.3, temperature=0.9, top_p=0.8),
         [hf.RepetitionPenaltyLogitsProcessor(1.3), hf.TemperatureLogitsWarper(0.9), hf.TopPLogitsWarper(0.8)]),
    ]
    for params, chain in cases:
        ours = LogitsProcessor(params).warp(z, seen_mask(ids, None, 50))
        theirs = z.clone()
        for proc in chain:
            theirs = proc(ids, theirs)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs)), params
        torch.testing.assert_close(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_tokens_to_keep=0), "min_tokens_to_keep"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [5e-324, 1e-50, 1e-40, 1e-30, 1e-20, 1e-12])
def test_a_tiny_temperature_samples_the_argmax(temperature: float):
    """logits / 1e-40 overflows float32 to inf, and softmax over an inf row is NaN (multinomial refused it); below
    float32's least normal the temperature itself is 0 there, and 0/0 is NaN: a tiny positive temperature must
    behave as its limit, greedy, with ties kept."""
    z = torch.tensor([[1.0, 3.0, -2.0, float("-inf"), 2.5], [0.5, 0.5, -1.0, 0.0, 0.25]])
    proc = LogitsProcessor(SamplingParams(temperature=temperature, top_p=0.9))
    probs = proc.probs(z)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(probs[1], torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0]))
    assert proc.select(z, generator=torch.Generator().manual_seed(0))[0].item() == 1

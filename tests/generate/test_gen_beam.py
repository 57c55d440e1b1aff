"""Beam search == exhaustive search when the beam holds every prefix; == Hugging Face beam search otherwise."""
from __future__ import annotations

import itertools

import pytest
import torch
from gen_helpers import TIE_TOL, float64_copy, hf_llama_pair, tiny_decoder, tiny_encdec

from seqlab.generate import GenerationConfig, generate, generate_output

V, EOS, N = 4, 3, 3  # vocabulary, EOS id, max_new_tokens


def all_sequences(eos: int, vocab: int, n: int):
    """Every continuation beam search could return: ends in EOS, or reaches n tokens."""
    others = [t for t in range(vocab) if t != eos]
    for length in range(1, n + 1):
        for body in itertools.product(others, repeat=length - 1):
            yield list(body) + [eos]
            if length == n:
                for last in others:
                    yield list(body) + [last]


@torch.no_grad()
def exhaustive_best(score_fn, eos: int, vocab: int, n: int, lp: float):
    best, best_score = None, -float("inf")
    for seq in all_sequences(eos, vocab, n):
        s = score_fn(seq) / len(seq) ** lp
        if s > best_score:
            best, best_score = seq, s
    return best, best_score


def decoder_logprob(model, prompt: list[int]):
    def score(seq):
        ids = torch.tensor([prompt + seq])
        logp = torch.log_softmax(model(ids)[0].double(), -1)
        return sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(seq))
    return score


def encdec_logprob(model, src: list[int]):
    start = model.config.decoder_start_token_id

    def score(seq):
        dec = torch.tensor([[start] + seq])
        logp = torch.log_softmax(model(torch.tensor([src]), decoder_input_ids=dec)[0].double(), -1)
        return sum(float(logp[i, t]) for i, t in enumerate(seq))
    return score


def assert_same_hypothesis_up_to_ties(got: list[int], want: list[int], score_fn, lp: float, what=""):
    """Beam search (cached, batched) and the reference rank hypotheses with differently rounded scores: they must
    return the same one, unless the two score the same in float64 up to TIE_TOL (see gen_helpers)."""
    if got != want:
        a, b = score_fn(got) / len(got) ** lp, score_fn(want) / len(want) ** lp
        assert abs(a - b) < TIE_TOL, f"{what}: {got} scores {a:.6f}, {want} scores {b:.6f}: not a near-tie"


def until_eos(seq: list[int], eos: int) -> list[int]:
    return seq[: seq.index(eos) + 1] if eos in seq else seq


@pytest.mark.parametrize("lp", [1.0, 0.0, 2.5, -0.7])
def test_beam_equals_exhaustive_search_decoder_batch(lp):
    model = tiny_decoder(seed=20, vocab_size=V, init_std=0.6)
    prompts = [[0, 2, 1, 1, 0], [2, 1]]
    ids = torch.tensor([prompts[0], [0, 0, 0] + prompts[1]])
    mask = torch.tensor([[1] * 5, [0, 0, 0, 1, 1]])
    K = (V - 1) ** (N - 1) * V  # every candidate of the last step ranks within the beam: nothing is pruned
    out = generate_output(model, ids, mask, GenerationConfig(max_new_tokens=N, num_beams=K, length_penalty=lp,
                                                             eos_token_id=EOS, early_stopping="never"))
    m64 = float64_copy(model)
    for i, p in enumerate(prompts):
        best, best_score = exhaustive_best(decoder_logprob(m64, p), EOS, V, N, lp)
        got = until_eos(out.sequences[i, 5:].tolist(), EOS)
        assert_same_hypothesis_up_to_ties(got, best, decoder_logprob(m64, p), lp, f"row {i}")
        assert abs(float(out.scores[i]) - best_score) < 1e-4  # float32 sums of log-probabilities


def test_beam_equals_exhaustive_search_encoder_decoder():
    model = tiny_encdec(seed=21, vocab_size=V, init_std=0.6, pad_token_id=1, bos_token_id=0, eos_token_id=EOS,
                        decoder_start_token_id=0)
    src = [0, 2, 2, 0, 3]  # no pad id (1): with no mask given, pad ids would be masked out (HF rule)
    K = (V - 1) ** (N - 1) * V
    out = generate_output(model, torch.tensor([src]), None,
                          GenerationConfig(max_new_tokens=N, num_beams=K, early_stopping="never"))
    score = encdec_logprob(float64_copy(model), src)
    best, best_score = exhaustive_best(score, EOS, V, N, 1.0)
    got = until_eos(out.sequences[0, 1:].tolist(), EOS)
    assert out.sequences[0, 0] == 0
    assert_same_hypothesis_up_to_ties(got, best, score, 1.0)
    assert abs(float(out.scores[0]) - best_score) < 1e-4


def test_small_beam_is_not_exhaustive_but_never_worse_than_greedy():
    """Sanity that the exhaustive test above has teeth: a 1-beam search can miss the optimum."""
    model = tiny_decoder(seed=20, vocab_size=V, init_std=0.6)
    misses = 0
    for p in ([0, 2, 1, 1, 0], [2, 1], [1], [3, 0, 2]):
        best, best_score = exhaustive_best(decoder_logprob(model, p), EOS, V, N, 1.0)
        out = generate_output(model, torch.tensor([p]), None,
                              GenerationConfig(max_new_tokens=N, num_beams=2, eos_token_id=EOS, early_stopping="never"))
        assert float(out.scores[0]) <= best_score + 1e-6
        greedy = generate(model, torch.tensor([p]), max_new_tokens=N, eos_token_id=EOS)[0, len(p):].tolist()
        greedy = greedy[: greedy.index(EOS) + 1] if EOS in greedy else greedy
        misses += greedy != best
    assert misses > 0


@pytest.mark.parametrize("early_stopping, lp", [(False, 1.0), (True, 1.0), ("never", 0.6), (False, -0.5)])
def test_beam_matches_hugging_face(early_stopping, lp):
    hf, model = hf_llama_pair(seed=22)
    T = 6
    ids = torch.tensor([[5, 9, 13, 2, 7, 31], [0, 0, 0, 40, 41, 42]])
    mask = torch.tensor([[1] * T, [0, 0, 0, 1, 1, 1]])
    eos = int(generate(model, ids, attention_mask=mask, max_new_tokens=4)[0, T + 1])
    ours = generate_output(model, ids, mask, GenerationConfig(max_new_tokens=10, num_beams=3, length_penalty=lp,
                                                              early_stopping=early_stopping, eos_token_id=eos))
    theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=10, num_beams=3, length_penalty=lp,
                         early_stopping=early_stopping, eos_token_id=eos, pad_token_id=eos, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    m64 = float64_copy(model)
    for i in range(2):
        prompt = ids[i][mask[i].bool()].tolist()
        assert_same_hypothesis_up_to_ties(until_eos(ours.sequences[i, T:].tolist(), eos),
                                          until_eos(theirs.sequences[i, T:].tolist(), eos),
                                          decoder_logprob(m64, prompt), lp, f"row {i}")
    # float32 sums of log-probabilities, accumulated in a different order by each library
    torch.testing.assert_close(ours.scores, theirs.sequences_scores, rtol=1e-4, atol=1e-4)


def test_beams_with_stop_strings_or_a_draft_are_refused_not_ignored():
    with pytest.raises(ValueError, match="beam search does not stop at stop_strings"):
        GenerationConfig(num_beams=2, stop_strings=["\n"])
    model = tiny_decoder(seed=3)
    with pytest.raises(ValueError, match="speculative decoding, which keeps one beam"):
        generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=2, num_beams=2, draft_model=tiny_decoder(seed=4))

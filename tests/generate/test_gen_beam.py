"""Beam search == exhaustive search when the beam holds every prefix; == Hugging Face beam search otherwise."""
from __future__ import annotations

import itertools

import pytest
import torch
from gen_helpers import hf_llama_pair, tiny_decoder, tiny_encdec

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


@pytest.mark.parametrize("lp", [1.0, 0.0, 2.5, -0.7])
def test_beam_equals_exhaustive_search_decoder_batch(lp):
    model = tiny_decoder(seed=20, vocab_size=V, init_std=0.6)
    prompts = [[0, 2, 1, 1, 0], [2, 1]]
    ids = torch.tensor([prompts[0], [0, 0, 0] + prompts[1]])
    mask = torch.tensor([[1] * 5, [0, 0, 0, 1, 1]])
    K = (V - 1) ** (N - 1) * V  # every candidate of the last step ranks within the beam: nothing is pruned
    out = generate_output(model, ids, mask, GenerationConfig(max_new_tokens=N, num_beams=K, length_penalty=lp,
                                                             eos_token_id=EOS, early_stopping="never"))
    for i, p in enumerate(prompts):
        best, best_score = exhaustive_best(decoder_logprob(model, p), EOS, V, N, lp)
        got = out.sequences[i, 5:].tolist()
        got = got[: got.index(EOS) + 1] if EOS in got else got
        assert got == best, (i, got, best)
        assert abs(float(out.scores[i]) - best_score) < 1e-4


def test_beam_equals_exhaustive_search_encoder_decoder():
    model = tiny_encdec(seed=21, vocab_size=V, init_std=0.6, pad_token_id=1, bos_token_id=0, eos_token_id=EOS,
                        decoder_start_token_id=0)
    src = [0, 2, 2, 0, 3]  # no pad id (1): with no mask given, pad ids would be masked out (HF rule)
    K = (V - 1) ** (N - 1) * V
    out = generate_output(model, torch.tensor([src]), None,
                          GenerationConfig(max_new_tokens=N, num_beams=K, early_stopping="never"))
    best, best_score = exhaustive_best(encdec_logprob(model, src), EOS, V, N, 1.0)
    got = out.sequences[0, 1:].tolist()
    got = got[: got.index(EOS) + 1] if EOS in got else got
    assert out.sequences[0, 0] == 0 and got == best
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
    assert torch.equal(ours.sequences, theirs.sequences)
    torch.testing.assert_close(ours.scores, theirs.sequences_scores, rtol=1e-4, atol=1e-4)

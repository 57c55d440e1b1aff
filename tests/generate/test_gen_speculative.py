"""Speculative decoding: exact acceptance rule, greedy equivalence, and the target's output distribution."""
from __future__ import annotations


import numpy as np
import pytest
import torch
from gen_helpers import assert_same_tokens_up_to_ties, decoder_oracle, tiny_decoder, tiny_encdec
from scipy import stats

from seqlab.generate import GenerationConfig, generate, generate_output

PROMPTS = [[5, 9, 13, 2, 7, 31, 4], [11, 3], [40, 41, 42, 1, 17]]


def left_pad(prompts, pad=0):
    T = max(map(len, prompts))
    return (torch.tensor([[pad] * (T - len(p)) + p for p in prompts]),
            torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts]))


def test_draft_equal_to_target_accepts_every_token():
    model = tiny_decoder(seed=30)
    ids, mask = left_pad(PROMPTS)
    for cfg in (GenerationConfig(max_new_tokens=17, do_sample=True, temperature=1.0, num_speculative_tokens=3),
                GenerationConfig(max_new_tokens=17, num_speculative_tokens=5)):
        out = generate_output(model, ids, mask, cfg, draft_model=model)
        m = out.metrics
        assert m.drafted_tokens > 0 and m.acceptance_rate == 1.0, m
        assert m.new_tokens == 3 * 17


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculative_equals_greedy(k):
    target, draft = tiny_decoder(seed=31), tiny_decoder(seed=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1)
    ids, mask = left_pad(PROMPTS)
    ref = generate(target, ids, attention_mask=mask, max_new_tokens=25)
    out = generate_output(target, ids, mask, GenerationConfig(max_new_tokens=25, num_speculative_tokens=k),
                          draft_model=draft)
    # the target's verify pass (K+1 positions) and plain decode steps round differently: equal up to near-ties
    oracle = decoder_oracle(target, ids, mask)
    assert out.sequences.shape == ref.shape
    assert_same_tokens_up_to_ties(out.sequences, ref, ids.shape[1], oracle)
    assert 0.0 <= out.metrics.acceptance_rate < 1.0  # a different draft: some drafts are rejected
    # with EOS: rows stop at the same place and are padded the same way
    eos = int(ref[1, ids.shape[1] + 4])
    ref = generate(target, ids, attention_mask=mask, max_new_tokens=25, eos_token_id=eos)
    out = generate(target, ids, attention_mask=mask, max_new_tokens=25, eos_token_id=eos, draft_model=draft,
                   num_speculative_tokens=k)
    if not assert_same_tokens_up_to_ties(out, ref, ids.shape[1], oracle):
        assert out.shape == ref.shape


def test_sampled_output_distribution_matches_target():
    """N copies of one prompt decoded together (so rows accept different numbers of drafts and the per-row
    cache rollback is exercised); the joint law of three new tokens must be the target's, not the draft's."""
    V, temp, top_p = 5, 1.0, 0.95
    target = tiny_decoder(seed=33, vocab_size=V, init_std=0.5)
    draft = tiny_decoder(seed=34, vocab_size=V, init_std=0.5, d_model=16, n_layers=1)
    prompt = [1, 3, 0, 2]
    N = 12000
    cfg = GenerationConfig(max_new_tokens=3, do_sample=True, temperature=temp, top_p=top_p,
                           num_speculative_tokens=2, seed=5)
    out = generate_output(target, torch.tensor([prompt] * N), None, cfg, draft_model=draft)
    acc = out.metrics.acceptance_rate
    assert 0.2 < acc < 0.95, acc  # both acceptance and rejection (residual resampling) happen
    new = out.sequences[:, len(prompt):].numpy()
    codes = (new * np.array([V * V, V, 1])).sum(1)
    counts = np.bincount(codes, minlength=V ** 3)

    def warped(model, ctx):
        with torch.no_grad():
            z = model(torch.tensor([ctx]))[0, -1].double() / temp
        p = torch.softmax(z, -1)
        sp, order = p.sort(descending=True)
        before = sp.cumsum(0) - sp
        n = max(int((before < top_p - 1e-9).sum()), 1)
        p = torch.where(p >= sp[n - 1], p, torch.zeros_like(p))
        return (p / p.sum()).numpy()

    def joint(model):
        probs = np.zeros(V ** 3)
        p1 = warped(model, prompt)
        for a in range(V):
            p2 = warped(model, prompt + [a])
            for b in range(V):
                p3 = warped(model, prompt + [a, b])
                for c in range(V):
                    probs[a * V * V + b * V + c] = p1[a] * p2[b] * p3[c]
        return probs

    p_target, p_draft = joint(target), joint(draft)
    assert counts[p_target == 0].sum() == 0

    def pvalue(p):
        big = p * N >= 5  # pool the rare cells so the chi-square approximation holds
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(p[big], p[~big].sum()) * N
        if (obs[exp == 0] > 0).any():
            return 0.0  # draws where the model has no mass: certainly not this model
        keep = exp > 0
        return stats.chisquare(obs[keep], exp[keep]).pvalue

    assert pvalue(p_target) > 1e-3
    assert pvalue(p_draft) < 1e-6  # the test can tell the two models apart


def test_speculative_errors():
    target = tiny_decoder(seed=35)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="share the tokenizer"):
        generate(target, ids, draft_model=tiny_decoder(vocab_size=30))
    with pytest.raises(ValueError, match="repetition_penalty"):
        generate(target, ids, draft_model=target, repetition_penalty=1.2)
    with pytest.raises(ValueError, match="decoder-only"):
        generate(tiny_encdec(), ids, draft_model=tiny_encdec())
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        generate(target, ids, draft_model=target, num_speculative_tokens=0)


def test_a_stop_string_cuts_a_speculative_round_where_greedy_stops():
    """A round adds up to K+1 tokens at once; the ones after the token that completes a stop string are not part
    of the output (they were kept, and streamed), so speculative decoding with a stop string matches greedy."""
    from seqlab.data import ByteTokenizer

    tok = ByteTokenizer()
    model = tiny_decoder(seed=33, vocab_size=tok.vocab_size)
    ids = torch.tensor([tok.encode("To be")])
    plain = generate_output(model, ids, None, GenerationConfig(max_new_tokens=24, eos_token_id=[]), tokenizer=tok)
    text = tok.decode(plain.sequences[0, ids.shape[1]:].tolist())
    stop = next(text[i:i + 2] for i in range(3, len(text) - 4) if "\ufffd" not in text[i:i + 2]
                and text.find(text[i:i + 2]) == i)
    cfg = dict(max_new_tokens=24, eos_token_id=[], stop_strings=[stop])
    greedy = generate_output(model, ids, None, GenerationConfig(**cfg), tokenizer=tok)
    spec = generate_output(model, ids, None, GenerationConfig(**cfg, num_speculative_tokens=4), tokenizer=tok,
                           draft_model=model)  # the draft is the target: every round is 5 tokens long
    if not assert_same_tokens_up_to_ties(spec.sequences, greedy.sequences, ids.shape[1],
                                         decoder_oracle(model, ids, None)):
        assert spec.sequences.tolist() == greedy.sequences.tolist()
    assert tok.decode(greedy.sequences[0, ids.shape[1]:].tolist()).endswith(stop)


def test_a_learned_position_table_too_short_for_the_lookahead_is_named():
    """Learned positions end at max_seq_len; a round reads K positions past the last token it keeps, so a request
    that fits greedy decoding may not fit speculative decoding: said up front, with what to lower. The bound is on
    positions, not cache slots: a batch's rejected drafts leave holes that positions skip, and a batch of two that
    reached 34 of 64 positions was refused for its 111 slots."""
    model = tiny_decoder(seed=34, pos="learned", max_seq_len=32)
    draft = tiny_decoder(seed=35, pos="learned", max_seq_len=32)
    ids = torch.tensor([[5, 9, 13, 2, 7, 31]])
    assert generate(model, ids, max_new_tokens=26).shape[1] == 32
    with pytest.raises(ValueError, match=r"prompt of 6 tokens \+ max_new_tokens=23 \+ the drafts' look-ahead 4 = 33 "
                                         r"exceeds the model's context"):
        generate_output(model, ids, None, GenerationConfig(max_new_tokens=23, num_speculative_tokens=4),
                        draft_model=model)
    for d in (model, draft):  # every draft accepted (the farthest look-ahead), and some rejected
        out = generate_output(model, ids, None, GenerationConfig(max_new_tokens=22, num_speculative_tokens=4),
                              draft_model=d)
        assert_same_tokens_up_to_ties(out.sequences, generate(model, ids, max_new_tokens=22), ids.shape[1],
                                      decoder_oracle(model, ids, None))
    batch = torch.tensor([[5, 9, 13, 2, 7, 31], [0, 0, 0, 4, 8, 12]])
    mask = (batch != 0).long()
    out = generate_output(model, batch, mask, GenerationConfig(max_new_tokens=22, num_speculative_tokens=4,
                                                               pad_token_id=0), draft_model=draft)
    assert_same_tokens_up_to_ties(out.sequences, generate(model, batch, mask, max_new_tokens=22, pad_token_id=0),
                                  batch.shape[1], decoder_oracle(model, batch, mask))
    long = torch.randint(1, 48, (1, 40))  # truncate_prompt keeps room for the look-ahead too
    cfg = GenerationConfig(max_new_tokens=10, num_speculative_tokens=4, truncate_prompt=True)
    out = generate_output(model, long, None, cfg, draft_model=draft)
    kept = long[:, -(32 - 10 - 4):]
    assert_same_tokens_up_to_ties(torch.cat([kept, out.sequences[:, -10:]], 1), generate(model, kept, max_new_tokens=10),
                                  kept.shape[1], decoder_oracle(model, kept, None))


def test_the_drafts_training_mode_is_restored():
    """The target's mode was restored after a request but the draft was left in eval mode."""
    model, draft = tiny_decoder(seed=1), tiny_decoder(seed=2).train()
    generate(model, torch.tensor([[3, 4, 5]]), max_new_tokens=4, draft_model=draft)
    assert draft.training and all(m.training for m in draft.modules())

"""The engine: cached decoding equals recomputation; batching, padding, stopping, streaming, errors, HF parity."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gen_helpers import (
    assert_same_tokens_up_to_ties,
    decoder_oracle,
    encdec_oracle,
    greedy_recompute,
    greedy_recompute_encdec,
    hf_llama_pair,
    tiny_decoder,
    tiny_encdec,
)
from scipy import stats

from seqlab.generate import GenerationConfig, generate, generate_output, stream
from tests.sp_tokenizer import sentencepiece_words


def left_pad(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(map(len, prompts))
    ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


PROMPTS = [[5, 9, 13, 2, 7, 31, 4], [11, 3], [40, 41, 42, 1, 17]]


def test_greedy_with_cache_equals_recomputation_rope_gqa():
    model = tiny_decoder()
    ids = torch.tensor([PROMPTS[0]])
    out = generate(model, ids, max_new_tokens=20)
    assert_same_tokens_up_to_ties(out, greedy_recompute(model, ids, 20), ids.shape[1], decoder_oracle(model, ids))


def test_greedy_learned_positions_and_tied_embeddings():
    model = tiny_decoder(seed=1, pos="learned", norm="layernorm", mlp="gelu", tie_embeddings=True, n_kv_heads=4)
    ids = torch.tensor([PROMPTS[2]])
    assert_same_tokens_up_to_ties(generate(model, ids, max_new_tokens=12), greedy_recompute(model, ids, 12),
                                  ids.shape[1], decoder_oracle(model, ids))


def test_left_padded_batch_equals_each_prompt_alone():
    model = tiny_decoder(seed=2)
    ids, mask = left_pad(PROMPTS)
    out = generate(model, ids, attention_mask=mask, max_new_tokens=15)
    T = ids.shape[1]
    assert torch.equal(out[:, :T], ids)  # the prompt comes back as given, padding included
    alone = torch.stack([torch.cat([ids[i, :T - len(p)], generate(model, torch.tensor([p]), max_new_tokens=15)[0]])
                         for i, p in enumerate(PROMPTS)])
    assert_same_tokens_up_to_ties(out, alone, T, decoder_oracle(model, ids, mask))
    for p in PROMPTS:
        one = torch.tensor([p])
        assert_same_tokens_up_to_ties(generate(model, one, max_new_tokens=15), greedy_recompute(model, one, 15),
                                      len(p), decoder_oracle(model, one))


def test_the_tie_check_rejects_a_real_difference():
    model = tiny_decoder()
    ids = torch.tensor([PROMPTS[0]])
    out = generate(model, ids, max_new_tokens=6)
    oracle = decoder_oracle(model, ids)
    wrong = out.clone()
    wrong[0, 9] = int(oracle(0, out[0, :9]).argmin())  # the least likely token: far from any tie
    with pytest.raises(AssertionError, match="not rounding"):
        assert_same_tokens_up_to_ties(wrong, out, ids.shape[1], oracle)
    with pytest.raises(AssertionError, match="inside the prompt"):
        assert_same_tokens_up_to_ties(out, torch.cat([ids + 1, out[:, 7:]], dim=1), ids.shape[1], oracle)


def test_right_padded_batch_equals_each_prompt_alone():
    model = tiny_decoder(seed=3)
    T = max(map(len, PROMPTS))
    ids = torch.tensor([p + [0] * (T - len(p)) for p in PROMPTS])
    mask = torch.tensor([[1] * len(p) + [0] * (T - len(p)) for p in PROMPTS])
    out = generate(model, ids, attention_mask=mask, max_new_tokens=10)
    alone = torch.stack([torch.cat([ids[i], generate(model, torch.tensor([p]), max_new_tokens=10)[0, len(p):]])
                         for i, p in enumerate(PROMPTS)])
    assert_same_tokens_up_to_ties(out, alone, T, decoder_oracle(model, ids, mask))


def test_encoder_decoder_greedy_with_cache_equals_recomputation():
    model = tiny_encdec()
    src, mask = left_pad([[3, 8, 9, 12, 30, 4], [7, 6, 5]], pad=1)
    out = generate(model, src, attention_mask=mask, max_new_tokens=12, eos_token_id=[])
    assert out[:, 0].tolist() == [2, 2]  # starts with the decoder start token, like HF
    real = [src[i][mask[i].bool()] for i in range(2)]
    ref = torch.cat([greedy_recompute_encdec(model, r[None], 12) for r in real])
    assert_same_tokens_up_to_ties(out, ref, 1, encdec_oracle(model, real))


def test_eos_stops_rows_and_pads_after_it_and_compaction_changes_nothing():
    model = tiny_decoder(seed=4)
    ids, mask = left_pad(PROMPTS)
    free = generate(model, ids, attention_mask=mask, max_new_tokens=16)
    T = ids.shape[1]
    eos = int(free[1, T + 3])  # a token that row 1 emits at step 3: make it EOS
    out = generate(model, ids, attention_mask=mask, max_new_tokens=16, eos_token_id=eos)
    out_nc = generate_output(model, ids, mask, GenerationConfig(max_new_tokens=16, eos_token_id=eos,
                                                                 pad_token_id=47, compact_finished=False)).sequences
    stops = [(g.index(eos) + 1 if eos in g else 16) for g in free[:, T:].tolist()]

    def stopped(pad: int) -> torch.Tensor:  # free decoding cut after each row's first EOS, then padded
        return torch.stack([torch.cat([free[i, :T + n], torch.full((16 - n,), pad)]) for i, n in enumerate(stops)])

    # compaction changes the batch size, hence the kernels: a row that diverges at a near-tie is not compared further
    oracle = decoder_oracle(model, ids, mask)
    tied = assert_same_tokens_up_to_ties(out, stopped(eos)[:, :out.shape[1]], T, oracle)  # no pad id: EOS pads
    tied |= assert_same_tokens_up_to_ties(out_nc, stopped(47)[:, :out_nc.shape[1]], T, oracle)
    if not tied:
        assert out.shape[1] == T + max(stops)


def test_matches_hugging_face_generate_greedy_left_padded():
    hf, model = hf_llama_pair(seed=5)
    ids, mask = left_pad(PROMPTS)
    oracle = decoder_oracle(model, ids, mask)
    ours = generate(model, ids, attention_mask=mask, max_new_tokens=12)
    theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert ours.shape == theirs.shape
    assert_same_tokens_up_to_ties(ours, theirs, ids.shape[1], oracle)
    eos = int(theirs[0, ids.shape[1] + 2])
    ours = generate(model, ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos)
    theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos)
    assert_same_tokens_up_to_ties(ours, theirs, ids.shape[1], oracle)


def test_sampled_two_token_joint_distribution_matches_exact():
    """Many copies of one prompt in one batch: the joint law of the first two sampled tokens (through the
    cache) matches the product of the exactly warped conditionals computed without a cache."""
    model = tiny_decoder(seed=6, vocab_size=6, init_std=0.5)
    prompt = torch.tensor([[1, 4, 2]])
    N, temp, top_k = 12000, 0.9, 4
    out = generate(model, prompt.expand(N, -1), max_new_tokens=2, do_sample=True, temperature=temp, top_k=top_k,
                   seed=11)
    pairs = out[:, 3] * 6 + out[:, 4]
    counts = np.bincount(pairs.numpy(), minlength=36)

    def warped(logits):
        z = logits.double() / temp
        kth = z.topk(top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
        return torch.softmax(z, -1)

    with torch.no_grad():
        p1 = warped(model(prompt)[0, -1])
        cand = torch.cat([prompt.expand(6, -1), torch.arange(6)[:, None]], 1)
        p2 = torch.stack([warped(row) for row in model(cand)[:, -1]])
    joint = (p1[:, None] * p2).flatten().numpy()
    assert counts[joint == 0].sum() == 0
    keep = joint > 0
    pval = stats.chisquare(counts[keep], joint[keep] / joint[keep].sum() * N).pvalue
    assert pval > 1e-3, pval


def test_seeded_sampling_is_reproducible_and_seed_matters():
    model = tiny_decoder(seed=7)
    ids = torch.tensor([PROMPTS[0]] * 4)
    a = generate(model, ids, max_new_tokens=10, do_sample=True, top_p=0.9, seed=3)
    b = generate(model, ids, max_new_tokens=10, do_sample=True, top_p=0.9, seed=3)
    c = generate(model, ids, max_new_tokens=10, do_sample=True, top_p=0.9, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(generate(model, ids, max_new_tokens=6, do_sample=True, temperature=0.0),
                       generate(model, ids, max_new_tokens=6))  # temperature 0 is greedy


def test_repetition_penalty_matches_hf():
    hf, model = hf_llama_pair(seed=8)
    ids, mask = left_pad(PROMPTS[:2])
    ours = generate(model, ids, attention_mask=mask, max_new_tokens=10, repetition_penalty=1.8)
    theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, repetition_penalty=1.8,
                         pad_token_id=0)
    assert ours.shape == theirs.shape
    assert_same_tokens_up_to_ties(ours, theirs, ids.shape[1], decoder_oracle(model, ids, mask, repetition_penalty=1.8))
    assert not torch.equal(ours, generate(model, ids, attention_mask=mask, max_new_tokens=10))


class CharTokenizer:
    """token id -> one character (ids >= 26 map to digits/punctuation); enough for stop strings and streaming."""

    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?-+*/=:;@#$%"

    def decode(self, ids):
        return "".join(self.alphabet[i] for i in ids)


def test_stream_yields_the_same_tokens_and_text_and_metrics():
    model = tiny_decoder(seed=9)
    ids, mask = left_pad(PROMPTS)
    ref = generate(model, ids, attention_mask=mask, max_new_tokens=8)
    s = stream(model, ids, mask, max_new_tokens=8, tokenizer=CharTokenizer())
    pieces = [[] for _ in range(3)]
    texts = ["" for _ in range(3)]
    for chunk in s:
        for r in range(3):
            pieces[r] += chunk.tokens[r]
            texts[r] += chunk.texts[r]
    T = ids.shape[1]
    assert [ref[r, T:].tolist() for r in range(3)] == pieces
    assert texts == [CharTokenizer().decode(p) for p in pieces]
    m = s.output.metrics
    assert torch.equal(s.output.sequences, ref)
    assert m.new_tokens == 24 and m.ttft_s > 0 and m.decode_tokens_per_s > 0 and m.total_s >= m.ttft_s
    assert m.kv_cache_bytes == 2 * 2 * 3 * 2 * (T + 8) * 8 * 4 + 3 * (T + 8)  # K,V x layers x B x Hkv x slots x hd x fp32 + valid
    assert m.peak_memory_bytes > 0


def test_stop_strings():
    model = tiny_decoder(seed=10)
    ids = torch.tensor([PROMPTS[0]])
    tok = CharTokenizer()
    free = generate(model, ids, max_new_tokens=20)[0, 7:].tolist()
    text = tok.decode(free)
    stop = text[5:7]
    cut = text.index(stop) + len(stop)  # first occurrence; with one char per token, tokens == chars
    out = generate(model, ids, max_new_tokens=20, stop_strings=[stop], tokenizer=tok)
    assert tok.decode(out[0, 7:].tolist()) == text[:cut]
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, ids, max_new_tokens=4, stop_strings=["x"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_p=0.0), r"GenerationConfig\.top_p must be in \(0, 1\]"),
        (dict(top_p=1.01), r"top_p"),
        (dict(temperature=-1.0), r"GenerationConfig\.temperature must be >= 0"),
        (dict(top_k=-2), r"GenerationConfig\.top_k"),
        (dict(min_p=1.5), r"GenerationConfig\.min_p"),
        (dict(max_new_tokens=-1), r"GenerationConfig\.max_new_tokens"),
        (dict(num_beams=0), r"GenerationConfig\.num_beams"),
        (dict(num_beams=2, do_sample=True), r"beam search with sampling"),
        (dict(repetition_penalty=-1.0), r"repetition_penalty"),
        (dict(eos_token_id=48), r"eos_token_id 48 is outside the model's vocabulary \[0, 48\)"),
        (dict(eos_token_id=[3, 60]), r"eos_token_id 60 is outside the model's vocabulary"),
        (dict(eos_token_id=-1), r"GenerationConfig\.eos_token_id must be"),
        (dict(pad_token_id=48), r"pad_token_id 48 is outside the model's vocabulary \[0, 48\)"),
        (dict(pad_token_id=-2), r"GenerationConfig\.pad_token_id must be"),
    ],
)
def test_invalid_parameters_raise(kwargs, match):
    model = tiny_decoder()
    with pytest.raises(ValueError, match=match):
        generate(model, torch.tensor([[1, 2, 3]]), **kwargs)


def test_over_long_prompt_raises_or_truncates():
    model = tiny_decoder(max_seq_len=16)
    long = torch.arange(20)[None] % 48
    with pytest.raises(ValueError, match=r"prompt of 20 tokens.*max_seq_len=16.*truncate_prompt"):
        generate(model, long, max_new_tokens=4)
    # the model reads the last 16 tokens; the output keeps the prompt as given, so out[:, 20:] is the new tokens
    out = generate(model, long, max_new_tokens=4, truncate_prompt=True)
    assert out.shape == (1, 24) and torch.equal(out[:, :20], long)
    assert torch.equal(out[:, 20:], generate(model, long[:, -16:], max_new_tokens=4)[:, 16:])
    learned = tiny_decoder(pos="learned", max_seq_len=16)
    with pytest.raises(ValueError, match=r"prompt of 12 tokens \+ max_new_tokens=8 = 20 exceeds"):
        generate(learned, long[:, :12], max_new_tokens=8)
    out = generate(learned, long[:, :12], max_new_tokens=8, truncate_prompt=True)
    assert out.shape == (1, 20) and torch.equal(out[:, :12], long[:, :12])
    assert torch.equal(out[:, 12:], generate(learned, long[:, 4:12], max_new_tokens=8)[:, 8:])
    with pytest.raises(ValueError, match=r"source of 19 tokens exceeds"):
        generate(tiny_encdec(max_seq_len=16), long % 40, max_new_tokens=4)  # id 1 is the pad id: 19 real
    with pytest.raises(ValueError, match=r"max_new_tokens=16 \+ the decoder start token exceeds"):
        generate(tiny_encdec(max_seq_len=16), long[:, :5] % 40, max_new_tokens=16)
    with pytest.raises(ValueError, match="no real prompt tokens"):
        generate(model, torch.tensor([[1, 2], [3, 4]]), attention_mask=torch.tensor([[1, 1], [0, 0]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, torch.tensor([[1, 99]]))


def test_max_new_tokens_zero_returns_prompt():
    model = tiny_decoder()
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(generate(model, ids, max_new_tokens=0), ids)


def test_generation_runs_in_eval_mode_and_leaves_each_modules_mode_as_it_was():
    """A model in training mode (dropout on) generates as in eval mode; afterwards every module is back in its own
    mode, including a submodule kept in eval inside a training model, and a stream closed early restores too."""
    model = tiny_decoder(dropout=0.5)
    ids = torch.tensor([[3, 5, 7]])
    want = generate(model, ids, max_new_tokens=6)  # eval mode (tiny_decoder returns the model in eval)
    model.train()
    frozen = next(m for name, m in model.named_modules() if name.endswith("blocks.0"))
    frozen.eval()  # e.g. a frozen block
    modes = {name: m.training for name, m in model.named_modules()}
    assert torch.equal(generate(model, ids, max_new_tokens=6), want)  # no dropout during generation
    assert {name: m.training for name, m in model.named_modules()} == modes
    chunks = iter(stream(model, ids, max_new_tokens=6))
    next(chunks)
    assert not model.training  # inside the request
    chunks.close()
    assert {name: m.training for name, m in model.named_modules()} == modes


def test_generate_keywords_override_a_config_even_at_their_default_values():
    """``generate(config=cfg, do_sample=False, max_new_tokens=32)``: both keywords win, although each equals the
    function's default (they were dropped as "not given", and the config's sampling ran)."""
    model = tiny_decoder(seed=44)
    ids = torch.tensor([[5, 9, 13, 2]])
    sampling = GenerationConfig(max_new_tokens=20, do_sample=True, temperature=0.9, seed=7)
    greedy = generate(model, ids, max_new_tokens=32)
    assert torch.equal(generate(model, ids, config=sampling, max_new_tokens=32, do_sample=False), greedy)
    assert generate(model, ids, config=sampling).shape[1] == ids.shape[1] + 20  # not given: the config's
    reseeded = generate(model, ids, config=sampling.updated(seed=0))
    assert torch.equal(generate(model, ids, config=sampling, seed=0), reseeded)


def test_streamed_text_is_the_final_text_and_beam_streams_its_text():
    """A row whose generation ends inside a UTF-8 sequence: the held-back piece (U+FFFD) is final then, and the
    stream hands it out, so the joined chunks equal the decoded output; beam search's one chunk carries its text."""
    from seqlab.data import ByteTokenizer

    tok = ByteTokenizer()
    ids = torch.tensor([tok.encode("To be")])
    ends_mid_character = 0
    for seed in range(12):
        model = tiny_decoder(seed=seed, vocab_size=tok.vocab_size)
        s = stream(model, ids, None, GenerationConfig(max_new_tokens=13, eos_token_id=[]), tokenizer=tok)
        joined = "".join(chunk.texts[0] for chunk in s)
        final = tok.decode(s.output.sequences[0, ids.shape[1]:].tolist())
        assert joined == final, seed
        ends_mid_character += final.endswith("\ufffd")
    assert ends_mid_character > 0  # the case the test is for did occur
    beams = stream(model, ids, None, GenerationConfig(max_new_tokens=6, num_beams=3, eos_token_id=[]), tokenizer=tok)
    (chunk,) = list(beams)
    assert chunk.texts[0] == tok.decode(beams.output.sequences[0, ids.shape[1]:].tolist())


def test_a_continuation_reads_on_from_its_prompt():
    """Decoded alone, the first new word lost its space under a SentencePiece decoder: "To be" + "▁be" printed
    "To bebe" (the CLI and streamed text), where HF's tokenizer reads the whole sequence as "To be be"."""
    from seqlab.generate.text import TextTracker, read_on

    tok = sentencepiece_words()
    prompt, new = tok.encode("To be"), tok.encode("be or not")
    assert tok.decode(prompt + new) == "To be be or not"
    assert "To be" + read_on(tok, prompt[-1:], new) == tok.decode(prompt + new)
    tracker = TextTracker(tok, 1, [], context=[prompt[-1:]])
    assert "".join(tracker.push(0, [t])[0] for t in new) == " be or not"


def test_a_stop_string_spelled_as_a_special_token_stops():
    """HF's stop strings match token strings, special tokens included; seqlab looked only in the text with the
    special tokens skipped, so ``stop=["</s>"]`` never stopped."""
    from seqlab.generate.text import TextTracker

    tok = sentencepiece_words()
    tracker = TextTracker(tok, 1, ["</s>"], context=[tok.encode("To")])
    assert tracker.push(0, tok.encode("be or")) == (" be or", False)
    assert tracker.push(0, [tok.eos_id]) == ("", True)
    tracker = TextTracker(tok, 1, ["To"], context=[tok.encode("To")])  # the prompt's own text never stops a row
    assert tracker.push(0, tok.encode("be")) == (" be", False)

"""The sliding-window scorer scores every token once and agrees with one full pass when the text fits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seqlab import ModelConfig, build_model
from seqlab.data.tokenizers import ByteTokenizer
from seqlab.eval.perplexity import score_text, sliding_window_nll
from tests.quant.conftest import tiny_decoder
from tests.sp_tokenizer import sentencepiece_words


def test_every_position_scored_once_and_full_pass_agrees():
    model = tiny_decoder()
    ids = torch.randint(0, 96, (50,)).tolist()
    nll, scored = sliding_window_nll(model, ids, window=64, stride=32)
    assert scored == list(range(1, 50))
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, :-1]
    ref = float(F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum"))
    assert abs(nll - ref) <= 1e-4 * ref


def test_long_text_every_position_scored_once():
    model = tiny_decoder()
    ids = torch.randint(0, 96, (150,)).tolist()
    nll, scored = sliding_window_nll(model, ids, window=40, stride=10)
    assert scored == list(range(1, 150)) and nll > 0


def test_an_encoder_is_refused_not_scored():
    """A bidirectional encoder sees the very token it would predict: its "perplexity" would mean nothing."""
    encoder = build_model(ModelConfig(arch="encoder", vocab_size=300, d_model=32, n_layers=1, n_heads=2))
    with pytest.raises(ValueError, match="this model is an encoder"):
        score_text(encoder, ByteTokenizer(), "some text to score")


def test_a_stride_of_the_whole_window_is_refused_and_one_less_scores_each_token_once():
    """At stride == window the next window's first token would be predicted from no position of its own window
    (it crashed inside cross_entropy); window - 1 is the widest stride that keeps one token of context."""
    model = tiny_decoder()
    ids = torch.randint(0, 96, (100,)).tolist()
    with pytest.raises(ValueError, match="stride 32 must be in 1..31"):
        sliding_window_nll(model, ids, window=32, stride=32)
    nll, scored = sliding_window_nll(model, ids, window=32, stride=31)
    assert scored == list(range(1, 100)) and nll > 0


def test_bos_follows_the_tokenizers_own_rule():
    """A tokenizer that adds no BOS (SmolLM2's GGUF says add_bos_token false) is scored as transformers' tok(text)
    and llama.cpp read the text: no BOS, the first token context only; a seqlab decoder's rule starts with BOS."""
    tok, text = ByteTokenizer(), "to be or not to be"
    model = build_model(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, max_seq_len=64))
    ids = tok.encode(text)
    plain = score_text(model, tok, text)
    assert plain.tokens == len(ids) - 1 and plain.bytes == len(text) - 1
    tok.set_special_rule(add_bos=True)
    ruled = score_text(model, tok, text)
    assert ruled.tokens == len(ids) and ruled.bytes == len(text)
    assert score_text(model, ByteTokenizer(), text, bos=True).nll == ruled.nll


def test_without_bos_the_first_tokens_own_bytes_leave_the_count():
    """Without BOS the first token is context only. A special one spelled in the text (a ChatML transcript under
    SmolLM2, which adds no BOS) kept its 12 bytes in the count, the byte table counting specials 0; a
    SentencePiece first word took off one byte too many, for the '▁' that is not in the text."""
    tok = ByteTokenizer()
    model = build_model(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, max_seq_len=64))
    text = "<|im_start|>user\nhi<|im_end|>\n"
    assert tok.encode(text)[0] == tok.token_id("<|im_start|>")
    assert score_text(model, tok, text, bos=False).bytes == len(text) - len("<|im_start|>")
    sp = sentencepiece_words()
    sp_model = build_model(ModelConfig(vocab_size=sp.vocab_size, d_model=16, n_layers=1, n_heads=2, max_seq_len=32))
    for text, first in (("To be or not to be.", "To"), ("be or not to be.", "be")):
        assert score_text(sp_model, sp, text, bos=False).bytes == len(text) - len(first)

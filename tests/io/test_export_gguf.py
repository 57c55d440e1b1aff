"""Export to GGUF: seqlab's ``load_gguf`` and the ``gguf`` package's own reader both read the file back.

f32 is lossless (the same weights, hence the same logits and greedy tokens); f16 keeps greedy tokens where the
source model's top-2 margin is clear of the rounding; for q8_0 / q4_0 / q4_1 every tensor read back dequantises
to exactly what ``gguf.quants`` made of the (rope-permuted) source values.
"""

import json
import warnings

import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Tokenizer as Backend, pre_tokenizers, processors

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from seqlab import ModelConfig, build_model  # noqa: E402
from seqlab.data.byte_lengths import bytes_to_unicode  # noqa: E402
from seqlab.data.tokenizer import Tokenizer  # noqa: E402
from seqlab.data.tokenizers import ByteTokenizer, train_bpe  # noqa: E402
from seqlab.generate import generate  # noqa: E402
from seqlab.io import load_gguf  # noqa: E402
from seqlab.io.export_gguf import export_gguf, gguf_name, rope_permutation  # noqa: E402
from seqlab.io.export_hf import ExportError, to_hf  # noqa: E402
from seqlab.io.gguf import reverse_rope_permutation  # noqa: E402
from seqlab.io.gguf_file import GGUFFile  # noqa: E402
from seqlab.io.tokenizer import GGUF_PRE_TOKENIZERS, tokenizer_from_gguf  # noqa: E402

TEXTS = ["the quick brown fox jumps over the lazy dog. " * 3, "hello world, hello there! 12345 numbers", "ünïcödé text"] * 4
PROMPT = "<|im_start|>user\nhello the quick fox<|im_end|>\n"


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(TEXTS, vocab_size=300)


def _model(vocab: int, **kw):
    torch.manual_seed(0)
    shape = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64) | kw
    model = build_model(ModelConfig(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _greedy(model, ids, n=8):
    return generate(model, ids, max_new_tokens=n, eos_token_id=[])


@pytest.mark.parametrize("tie", [True, False])
def test_f32_round_trip_is_exact(tmp_path, bpe, tie):
    model = _model(bpe.vocab_size, tie_embeddings=tie, rope_base=20000.0)
    path = export_gguf(model, tmp_path / "m.gguf", bpe, weight_type="f32")
    loaded, tok = load_gguf(path)
    assert loaded.config.rope_base == 20000.0 and loaded.config.n_kv_heads == 2
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = bpe.encode(PROMPT)
    assert tok.encode(PROMPT, add_special_tokens=False) == ids  # same ids from the file's vocabulary and merges
    assert tok.chat_template == bpe.chat_template
    assert tok.eos_id == bpe.eos_id and tok.bos_id == bpe.bos_id
    x = torch.tensor([ids])
    assert torch.equal(_greedy(loaded, x), _greedy(model, x))

    reader = gguf.GGUFReader(path)  # the package's own reader agrees on names, shapes and metadata
    names = {t.name for t in reader.tensors}
    assert ("output.weight" in names) == (not tie)
    assert int(reader.fields["llama.block_count"].parts[-1][0]) == 2
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    src = model.stack.blocks[0].attn.qkv.weight[:64].detach().numpy()
    np.testing.assert_array_equal(reverse_rope_permutation(np.asarray(q.data).reshape(64, 64), 4), src)


def test_f16_keeps_greedy_tokens(tmp_path, bpe):
    model = _model(bpe.vocab_size)
    loaded, _ = load_gguf(export_gguf(model, tmp_path / "m.gguf", bpe, weight_type="f16"))
    x = torch.tensor([bpe.encode(PROMPT)])
    ours = _greedy(model, x)
    with torch.no_grad():
        logits = model(ours)[:, x.shape[1] - 1:-1]
    top = logits.topk(2, dim=-1).values
    assert (top[..., 0] - top[..., 1]).min() > 1e-2, "test model has a near-tie; pick another seed"
    assert torch.equal(_greedy(loaded, x), ours)
    w = model.stack.blocks[1].mlp.down.weight.detach()
    assert torch.equal(loaded.stack.blocks[1].mlp.down.weight, w.half().float())


@pytest.mark.parametrize("weight_type", ["q8_0", "q4_0", "q4_1"])
def test_quantised_values_read_back_as_written(tmp_path, bpe, weight_type):
    model = _model(bpe.vocab_size, tie_embeddings=False)
    path = export_gguf(model, tmp_path / "m.gguf", bpe, weight_type=weight_type)
    qtype = getattr(gguf.GGMLQuantizationType, weight_type.upper())
    _, hf = to_hf(model)
    expected = {}
    for name, t in hf.items():
        values = t.numpy()
        if ".q_proj." in name:
            values = rope_permutation(values, 4)
        elif ".k_proj." in name:
            values = rope_permutation(values, 2)
        if values.ndim == 2:
            values = gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype)
        expected[gguf_name(name)] = values
    reader = gguf.GGUFReader(path)
    assert {t.name for t in reader.tensors} == set(expected)
    for t in reader.tensors:
        want_type = qtype if expected[t.name].ndim == 2 else gguf.GGMLQuantizationType.F32
        assert t.tensor_type == want_type, t.name
        got = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(expected[t.name].shape)
        np.testing.assert_array_equal(got, expected[t.name], err_msg=t.name)
    loaded, _ = load_gguf(path)  # seqlab's reader: the same dequantised values, back in seqlab's layout
    down = expected["blk.1.ffn_down.weight"]
    assert np.array_equal(loaded.stack.blocks[1].mlp.down.weight.detach().numpy(), down)
    assert weight_type.upper() in loaded.config.extra["gguf_tensor_types"]


def test_byte_tokenizer_round_trips(tmp_path):
    tok = ByteTokenizer()
    tok.set_special_rule(add_bos=True)
    model = _model(tok.vocab_size)
    path = export_gguf(model, tmp_path / "b.gguf", tok, weight_type="f32")
    loaded, gtok = load_gguf(path)
    text = "héllo <|im_start|>wörld<|im_end|>"
    assert gtok.encode(text, add_special_tokens=False) == tok.encode(text)
    assert gtok.encode(text, add_special_tokens=True) == [tok.bos_id] + tok.encode(text)  # the BOS rule travels
    assert gtok.decode(tok.encode(text), skip_special_tokens=False) == text
    # no merges, but the key is there: llama.cpp requires it for a gpt2 vocabulary, and transformers reads it
    assert GGUFFile(path).metadata["tokenizer.ggml.merges"] == []
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="b.gguf")
    assert hf_tok("héllo").input_ids == [tok.bos_id] + tok.encode("héllo")


def _split_by(tok, pre_tokenizer) -> Tokenizer:
    backend = Backend.from_str(tok.backend.to_str())
    backend.pre_tokenizer = pre_tokenizer
    return Tokenizer(backend, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id, name="split")


def test_the_pre_tokenizer_travels_or_the_export_is_refused(tmp_path, bpe):
    """SmolLM2's split (every digit its own piece) is written as "smollm", so the file read back splits numbers the
    same way; a split llama.cpp has no name for is refused, since a reader would tokenize differently."""
    digits = _split_by(bpe, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)]))
    path = export_gguf(_model(bpe.vocab_size), tmp_path / "d.gguf", digits, weight_type="f32")
    assert GGUFFile(path).metadata["tokenizer.ggml.pre"] == "smollm"
    assert export_gguf(_model(bpe.vocab_size), tmp_path / "g.gguf", bpe).name == "g.gguf"
    # llama.cpp's name for GPT-2's split: it knows no "gpt2", and falls back to other regexes (or refuses the file)
    assert GGUFFile(tmp_path / "g.gguf").metadata["tokenizer.ggml.pre"] == "gpt-2"
    text = "hello 12345 numbers, 3 foxes"
    assert load_gguf(path)[1].encode(text) == digits.encode(text) != bpe.encode(text)
    words = _split_by(bpe, pre_tokenizers.Whitespace())
    with pytest.raises(ExportError, match="pre-tokenizer splits text like none of llama.cpp's"):
        export_gguf(_model(bpe.vocab_size), tmp_path / "w.gguf", words)
    assert not (tmp_path / "w.gguf").exists()


def test_a_bos_the_post_processor_adds_travels_to_the_gguf(tmp_path, bpe):
    """A Llama-3 folder adds BOS in tokenizer.json's post-processor, with no add_bos_token in its config: the GGUF
    says add_bos_token true, so the file read back (and llama.cpp) starts prompts with BOS as seqlab did."""
    backend = Backend.from_str(bpe.backend.to_str())
    bos = bpe.token(bpe.bos_id)
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bpe.bos_id)])
    tok = Tokenizer(backend, bos_id=bpe.bos_id, eos_id=bpe.eos_id, pad_id=bpe.pad_id, name="llama3-like")
    assert not tok.add_bos_token and tok.encode("hello", add_special_tokens=True)[0] == bpe.bos_id
    path = export_gguf(_model(bpe.vocab_size), tmp_path / "b.gguf", tok)
    assert GGUFFile(path).metadata["tokenizer.ggml.add_bos_token"] is True
    assert load_gguf(path)[1].encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=True)


def test_added_tokens_and_the_unknown_id_survive_the_round_trip(tmp_path, bpe):
    """A tool tag added as a plain (not special) token was typed NORMAL, and a special spelled outside GPT-2's byte
    alphabet (DeepSeek's "<｜User｜>") was respelled on import: both came back as a dozen byte pieces. The unknown
    token's id was not written."""
    backend = Backend.from_str(bpe.backend.to_str())
    backend.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    backend.add_special_tokens([AddedToken("<｜User｜>", special=True, normalized=False)])
    tok = Tokenizer(backend, bos_id=bpe.bos_id, eos_id=bpe.eos_id, pad_id=bpe.pad_id, unk_id=bpe.eos_id, name="tools")
    path = export_gguf(_model(bpe.vocab_size + 2), tmp_path / "t.gguf", tok, weight_type="f32")
    meta = GGUFFile(path).metadata
    tool, user = backend.token_to_id("<tool_call>"), backend.token_to_id("<｜User｜>")
    assert meta["tokenizer.ggml.token_type"][tool] == 4 and meta["tokenizer.ggml.token_type"][user] == 3
    assert meta["tokenizer.ggml.unknown_token_id"] == bpe.eos_id
    back = load_gguf(path)[1]
    for text in ("<tool_call>hi there", "<｜User｜>hello"):
        assert back.encode(text) == tok.encode(text) and len(tok.encode(text)) < 10
    assert back.unk_id == bpe.eos_id


def test_explicit_head_dim_exports_as_llama_with_key_length(tmp_path, bpe):
    model = _model(bpe.vocab_size, attn_head_dim=24, tie_embeddings=False)
    path = export_gguf(model, tmp_path / "m.gguf", bpe, weight_type="f32")
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.attention.key_length"].contents() == 24
    assert reader.fields["llama.rope.dimension_count"].contents() == 24
    loaded, _ = load_gguf(path)
    assert loaded.config.head_dim == 24
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("kw,field", [
    (dict(pos="learned", norm="layernorm", mlp="gelu", bias=True), "ModelConfig.pos='learned'"),
    (dict(arch="encoder"), "ModelConfig.arch='encoder'"),
    (dict(qk_norm=True, qkv_bias=True), "GGUF qwen3: ModelConfig.qkv_bias=True"),  # llama.cpp's qwen3: no biases
])
def test_inexpressible_configs_are_refused(tmp_path, kw, field):
    model = _model(50, **kw)
    with pytest.raises(ExportError, match=field):
        export_gguf(model, tmp_path / "x.gguf")
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_rows_that_are_not_whole_blocks_are_written_f16_with_a_warning(tmp_path, bpe):
    """d_model 48 is no multiple of Q4_0's 32-value block: llama.cpp keeps such matrices f16, and so does the
    export, naming them (the file is larger and more exact than the type asked for), not silently."""
    model = _model(bpe.vocab_size, d_model=48, tie_embeddings=False)
    with pytest.warns(UserWarning, match=r"--weights q4_0: .* not whole blocks of 32 written f16.*attn_q\.weight"):
        path = export_gguf(model, tmp_path / "m.gguf", bpe, weight_type="q4_0")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.Q4_0  # its rows hold d_ff values


def _with_model(tok: Tokenizer, **bpe_fields) -> Tokenizer:
    doc = json.loads(tok.backend.to_str())
    doc["model"].update(bpe_fields)
    return Tokenizer(Backend.from_str(json.dumps(doc)), bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id,
                     name=tok.name)


def test_llama3_files_ignore_merges_as_llama_cpp_and_hf_do(tmp_path, bpe):
    """llama.cpp's Llama 3 family ("llama-bpe", "falcon3", ...) takes a piece that is in the vocabulary whole, as
    tokenizer.json's "ignore_merges": true does; seqlab applied the merges, and split "falcon3" and
    "deepseek-r1-qwen" files like GPT-2. "smaug-bpe" is the same split with the merges applied."""
    alias = bytes_to_unicode()
    tokens = [alias[b] for b in range(256)] + ["ab", "abc"]  # "abc" is in the vocabulary, no merge makes it
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": ["a b"],
            "tokenizer.ggml.bos_token_id": 0}
    ids = lambda pre: tokenizer_from_gguf(meta | {"tokenizer.ggml.pre": pre}).encode("abc")
    assert ids("llama-bpe") == ids("falcon3") == [257] and ids("smaug-bpe") == ids("qwen2") == [256, ord("c")]
    assert tokenizer_from_gguf(meta | {"tokenizer.ggml.pre": "falcon3"}).add_bos_token  # llama.cpp's default there
    ref = json.loads(tokenizer_from_gguf(meta | {"tokenizer.ggml.pre": "qwen2"}).backend.to_str())["pre_tokenizer"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known name: no "unknown pre-tokenizer" fallback
        alias_spec = json.loads(tokenizer_from_gguf(meta | {"tokenizer.ggml.pre": "deepseek-r1-qwen"})
                                .backend.to_str())["pre_tokenizer"]
    assert alias_spec == ref
    # the name written says whether merges are ignored, so the file reads back as the folder tokenizes
    llama3 = _split_by(bpe, GGUF_PRE_TOKENIZERS["llama3"]())
    for tok, name in ((_with_model(llama3, ignore_merges=True), "llama3"), (llama3, "smaug-bpe")):
        path = export_gguf(_model(bpe.vocab_size), tmp_path / f"{name}.gguf", tok, weight_type="f32")
        assert GGUFFile(path).metadata["tokenizer.ggml.pre"] == name
        back = load_gguf(path)[1]
        assert json.loads(back.backend.to_str())["model"]["ignore_merges"] == (name == "llama3")
        assert back.encode(" ".join(TEXTS)) == tok.encode(" ".join(TEXTS))

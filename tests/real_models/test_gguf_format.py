"""GGUF parsing, the Q/K permutation, and refusal of malformed / unsupported files (tiny files, fast)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from seqlab.io import GGUFError, load_gguf
from seqlab.io.gguf import read_gguf, reverse_rope_permutation
from tests.real_models.tiny_gguf import CONTROL, llamacpp_permute, write_tiny_llama

Q = gguf.GGMLQuantizationType


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.gguf"
    state = write_tiny_llama(path, qtypes={"blk.0.attn_q.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.Q4_1,
                                           "blk.1.attn_k.weight": Q.F16, "token_embd.weight": Q.Q8_0})
    return path, state


def test_parser_matches_gguf_reader(tiny):
    """Our bounds-checked parser reads the same metadata and tensors as the gguf package's reference reader."""
    path, _ = tiny
    ours = read_gguf(path)
    ref = gguf.GGUFReader(path)
    ref_meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == ref_meta
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        expected = gguf.quants.dequantize(t.data, t.tensor_type)
        got = ours.dequantize(t.name)
        assert ours.tensors[t.name].qtype == t.tensor_type
        np.testing.assert_array_equal(got, expected.reshape(got.shape), err_msg=t.name)


def test_reverse_rope_permutation_inverts_llamacpp():
    rng = np.random.default_rng(0)
    for n_heads, head_dim in ((4, 16), (3, 64), (1, 8)):
        w = rng.standard_normal((n_heads * head_dim, 24)).astype(np.float32)
        permuted = llamacpp_permute(w, n_heads)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(reverse_rope_permutation(permuted, n_heads), w)
        b = rng.standard_normal(n_heads * head_dim).astype(np.float32)  # biases permute the same way
        np.testing.assert_array_equal(reverse_rope_permutation(llamacpp_permute(b, n_heads), n_heads), b)


def test_tiny_llama_matches_hf_gguf_import(tiny):
    """Mixed F32/F16/Q8_0/Q4_1 tiny file with GQA: seqlab == HF transformers loading the same file."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    path, state = tiny
    model, tok = load_gguf(path)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    # the weights we wrote (after quantisation round trip), in HF convention, equal what both importers produce
    hf_sd = hf.state_dict()
    for name, value in state.items():
        np.testing.assert_allclose(hf_sd[name].numpy(), value, atol=1e-6, err_msg=name)
    ids = torch.tensor([tok.encode("the cat in the hat, 12 34")])
    with torch.no_grad():
        ours, ref = model(ids), hf(ids).logits
    assert (ours - ref).abs().max().item() < 1e-5
    assert model.config.n_kv_heads == 2 and model.config.n_heads == 4
    assert set(model.config.extra["gguf_tensor_types"]) == {"F32", "F16", "Q8_0", "Q4_1"}


def test_tiny_tokenizer_from_metadata(tiny):
    path, _ = tiny
    _, tok = load_gguf(path)
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>" and tok.pad_id == 2
    ids = tok.encode("<|im_start|>the there 42<|im_end|>")
    assert ids[0] == CONTROL.index("<|im_start|>") and ids[-1] == CONTROL.index("<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>the there 42<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "the there 42"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("cut", [3, 20, 200, 3000, "tensor_data", -1])
def test_truncated_file_is_refused(tiny, tmp_path, cut):
    path, _ = tiny
    data = path.read_bytes()
    if cut == "tensor_data":
        cut = len(data) // 2
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(GGUFError, match="truncated|not a GGUF"):
        load_gguf(bad)


def test_real_file_truncated_mid_tensors_is_refused(smollm_path, tmp_path):
    bad = tmp_path / "smollm_truncated.gguf"
    with open(smollm_path, "rb") as src:
        bad.write_bytes(src.read(60_000_000))
    with pytest.raises(GGUFError, match="truncated GGUF: tensor 'blk"):
        read_gguf(bad)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b'{"this": "is json"}' + b"\0" * 64)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        load_gguf(bad)
    with pytest.raises(GGUFError, match="no such file"):
        load_gguf(tmp_path / "missing.gguf")


def test_corrupted_lengths_are_refused(tiny, tmp_path):
    path, _ = tiny
    data = bytearray(path.read_bytes())
    # first metadata key's string length (offset 24): claim an absurd length
    data[24:32] = (2**62).to_bytes(8, "little")
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="malformed|truncated"):
        read_gguf(bad)
    data = bytearray(path.read_bytes())
    data[4:8] = (7).to_bytes(4, "little")  # unknown version
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="version 7"):
        read_gguf(bad)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    write_tiny_llama(path, arch="falcon")
    with pytest.raises(GGUFError, match="architecture 'falcon' is not supported"):
        load_gguf(path)


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "q8_1.gguf"
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    raw = np.zeros((4, 64 // block * size), dtype=np.uint8)
    write_tiny_llama(path, raw_tensors={"blk.0.attn_q_norm.weight": (raw, Q.Q8_1)})
    with pytest.raises(GGUFError, match="unknown tensors.*attn_q_norm"):
        load_gguf(path)
    path2 = tmp_path / "q8_1_known_name.gguf"
    # a known tensor stored in a type gguf cannot dequantise
    write_tiny_llama(path2, raw_tensors={"output.weight": (np.zeros((len(CONTROL) + 263, 64 // block * size), np.uint8), Q.Q8_1)})
    with pytest.raises(GGUFError, match="'output.weight' has type Q8_1"):
        load_gguf(path2)


def test_unsupported_tokenizer_model(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    f = read_gguf(path)
    from seqlab.data.tokenizer import TokenizerError
    from seqlab.io.tokenizer import tokenizer_from_gguf

    meta = dict(f.metadata, **{"tokenizer.ggml.model": "llama"})
    with pytest.raises(TokenizerError, match="tokenizer model 'llama' is not supported"):
        tokenizer_from_gguf(meta, source=str(path))


def test_bf16_load_and_tokenizer_save_round_trip(tiny, tmp_path):
    """dtype=bfloat16 gives a bf16 model close to fp32; a saved tokenizer.json is read identically by HF and by us."""
    from transformers import AutoTokenizer

    from seqlab.data.tokenizer import Tokenizer

    path, _ = tiny
    model, tok = load_gguf(path)
    model16, _ = load_gguf(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model16.parameters()} == {torch.bfloat16}
    ids = torch.tensor([tok.encode("the cat in the hat")])
    with torch.no_grad():
        diff = (model16(ids).float() - model(ids)).abs().max().item()
    assert 0 < diff < 0.05

    tok.save_pretrained(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok")
    back = Tokenizer.from_pretrained(tmp_path / "tok")
    for text in ("the  there 4 2\n\tin", "<|im_start|>hi<|im_end|>", "naïve 🤖"):
        assert back.encode(text) == tok.encode(text) == hf.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_special_tokens=True) == hf.encode(text)
    assert (back.bos_id, back.eos_id, back.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    msgs = [{"role": "user", "content": "hi"}]
    assert back.apply_chat_template(msgs, add_generation_prompt=True) == tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

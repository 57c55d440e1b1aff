"""Qwen2 and Qwen3 GGUF files, both ways, with Hugging Face ``transformers`` as the oracle.

Import: a random HF ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` is written to GGUF here the way llama.cpp's
convert_hf_to_gguf.py writes it (the ``gguf`` package's GGUFWriter, llama.cpp's tensor names and metadata keys, and
Q/K rows left in HF order, because qwen runs llama.cpp's "neox" rotary), independently of seqlab's exporter. Then
``load_gguf`` must match HF: logits within 1e-4, greedy tokens identical, KV-cached decode equal to recomputation.

Export: the same HF models imported by seqlab, ``seqlab export --format gguf``, read back by ``load_gguf`` (the same
greedy tokens) and by the ``gguf`` package's own GGUFReader (architecture, head size, tensor names).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from seqlab.cli import main  # noqa: E402
from seqlab.data.tokenizers import ByteTokenizer  # noqa: E402
from seqlab.generate import generate  # noqa: E402
from seqlab.io import GGUFError, load_gguf, load_hf  # noqa: E402
from seqlab.quant import QuantLinear  # noqa: E402
from tests.io.test_hf_architectures import SMALL, _check_parity, _randomised  # noqa: E402
from tests.real_models.tiny_gguf import TEMPLATE, tiny_vocab  # noqa: E402

Q = gguf.GGMLQuantizationType
TOKENS, TOKEN_TYPES, MERGES = tiny_vocab()
SHAPE = {**SMALL, "vocab_size": len(TOKENS)}  # the parity checks draw ids below SMALL's vocab: all valid here
MODELS = {
    "qwen2": lambda **kw: (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**{**SHAPE, "rope_theta": 20000.0, **kw})),
    "qwen3": lambda **kw: (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**{**SHAPE, "head_dim": 24, **kw})),
}
# llama.cpp's names (gguf.constants.TENSOR_NAMES), written out here rather than taken from seqlab
LLAMACPP_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _llamacpp_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LLAMACPP_NAMES[module]}.{kind}"


def write_like_llamacpp(path, hf, arch: str, qtypes: dict | None = None, extra: dict | None = None) -> None:
    """What convert_hf_to_gguf.py's Qwen2Model / Qwen3Model write (f32 unless ``qtypes`` names a tensor)."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if getattr(c, "head_dim", None) is not None:  # the converter writes HF's head_dim when the config has one
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(MERGES)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name, values = _llamacpp_name(name), t.detach().float().numpy()
        q = (qtypes or {}).get(name)
        if q is None or values.ndim == 1:
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, gguf.quants.quantize(values, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_llamacpp_style_file_matches_hf(tmp_path, arch):
    hf = _randomised(*MODELS[arch]())
    write_like_llamacpp(tmp_path / "m.gguf", hf, arch)
    ours, tok = load_gguf(tmp_path / "m.gguf")
    cfg = ours.config
    assert cfg.extra["source"] == f"gguf:{arch}"
    if arch == "qwen2":
        assert cfg.qkv_bias and not cfg.bias and not cfg.qk_norm and cfg.rope_base == 20000.0
    else:
        assert cfg.qk_norm and cfg.head_dim == 24 and cfg.attn_head_dim == 24 and not cfg.qkv_bias
    assert tok.eos_id == 2 and tok.chat_template == TEMPLATE
    _check_parity(hf, ours)


def test_tied_qwen2_has_no_output_tensor(tmp_path):
    hf = _randomised(*MODELS["qwen2"](tie_word_embeddings=True))
    write_like_llamacpp(tmp_path / "m.gguf", hf, "qwen2")
    ours, _ = load_gguf(tmp_path / "m.gguf", with_tokenizer=False)
    assert ours.config.tie_embeddings
    _check_parity(hf, ours)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_blocks_kept_quantised_need_no_row_permutation(tmp_path, arch):
    """quant="gguf" maps Q8_0 blocks straight onto int8 layers; qwen's Q/K rows must stay as stored."""
    hf = _randomised(*MODELS[arch]())
    linears = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    qtypes = {f"blk.{i}.{t}.weight": Q.Q8_0 for i in range(2) for t in linears} | {"output.weight": Q.Q8_0}
    write_like_llamacpp(tmp_path / "q.gguf", hf, arch, qtypes=qtypes)
    dense, _ = load_gguf(tmp_path / "q.gguf", with_tokenizer=False)
    quant, _ = load_gguf(tmp_path / "q.gguf", with_tokenizer=False, quant="gguf")
    qkv = quant.get_submodule("stack.blocks.0.attn.qkv")
    assert isinstance(qkv, QuantLinear) and qkv.bits == 8
    assert torch.equal(qkv.dequantize(), dense.get_submodule("stack.blocks.0.attn.qkv").weight)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 12))
    with torch.no_grad():
        a, b = dense(ids), quant(ids)
    assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max())


def test_sliding_window_is_refused_by_name(tmp_path):
    hf = _randomised(*MODELS["qwen2"]())
    write_like_llamacpp(tmp_path / "swa.gguf", hf, "qwen2", extra={"qwen2.attention.sliding_window": 16})
    with pytest.raises(GGUFError, match=r"qwen2\.attention\.sliding_window=16"):
        load_gguf(tmp_path / "swa.gguf")
    # a window as long as the context never binds: the same file loads
    write_like_llamacpp(tmp_path / "wide.gguf", hf, "qwen2", extra={"qwen2.attention.sliding_window": 64})
    wide, _ = load_gguf(tmp_path / "wide.gguf", with_tokenizer=False)
    assert wide.config.attention_window == 64  # and past it sequences are refused


def test_unequal_key_and_value_heads_are_refused(tmp_path):
    hf = _randomised(*MODELS["qwen3"]())
    write_like_llamacpp(tmp_path / "kv.gguf", hf, "qwen3")
    data = (tmp_path / "kv.gguf").read_bytes()
    key = b"qwen3.attention.value_length"
    at = data.index(key) + len(key) + 4  # then the uint32 type id, then the value
    assert int.from_bytes(data[at:at + 4], "little") == 24
    (tmp_path / "kv.gguf").write_bytes(data[:at] + (16).to_bytes(4, "little") + data[at + 4:])
    with pytest.raises(GGUFError, match="value_length=16 differs from qwen3.attention.key_length=24"):
        load_gguf(tmp_path / "kv.gguf")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_export_round_trip(tmp_path, arch, capsys):
    hf = _randomised(*MODELS[arch]())
    hf.save_pretrained(tmp_path / "hf")
    ByteTokenizer().save(tmp_path / "hf" / "tokenizer.json")
    source = load_hf(tmp_path / "hf")
    out = tmp_path / "m.gguf"
    assert main(["export", str(tmp_path / "hf"), "--format", "gguf", "--out", str(out)]) == 0

    reader = gguf.GGUFReader(out)  # the package's own reader: architecture, sizes and tensor names
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    assert field("general.architecture") == arch
    assert field(f"{arch}.block_count") == 2 and field(f"{arch}.attention.head_count_kv") == 2
    names = {t.name for t in reader.tensors}
    assert ("blk.0.attn_q_norm.weight" in names) == (arch == "qwen3")
    assert ("blk.0.attn_q.bias" in names) == (arch == "qwen2")
    if arch == "qwen3":
        assert field("qwen3.attention.key_length") == 24 and field("qwen3.attention.value_length") == 24
    q = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight")  # stored in HF's row order
    np.testing.assert_array_equal(np.asarray(q.data).reshape(q.data.shape),
                                  hf.model.layers[1].self_attn.q_proj.weight.detach().numpy())

    loaded, tok = load_gguf(out)
    mine, theirs = source.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ids = torch.tensor([tok.encode("hello qwen", add_special_tokens=False)])
    assert ids.max() < SHAPE["vocab_size"]
    assert torch.equal(generate(loaded, ids, max_new_tokens=8, eos_token_id=[]),
                       generate(source, ids, max_new_tokens=8, eos_token_id=[]))

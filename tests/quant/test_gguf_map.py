"""GGUF Q4_0 / Q4_1 / Q8_0 blocks map onto the int layouts exactly, and a GGUF model loads kept quantised."""
from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from seqlab.io import load_gguf
from seqlab.quant import QuantEmbedding, QuantLinear, dequantize_weight
from seqlab.quant.gguf_map import blocks_to_parts
from tests.real_models.tiny_gguf import write_tiny_llama

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_blocks_dequantise_to_the_gguf_values_bit_for_bit(qtype):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((24, 128)) * rng.uniform(0.01, 2, (24, 1))).astype(np.float32)
    blocks = gguf.quants.quantize(w, qtype)
    reference = gguf.quants.dequantize(blocks, qtype).reshape(w.shape)
    parts = blocks_to_parts(blocks.reshape(-1), qtype.name, w.shape[0])
    bits = 8 if qtype == Q.Q8_0 else 4
    ours = dequantize_weight(parts["qweight"], parts["scales"], parts.get("mins"), bits, 32)
    assert torch.equal(ours, torch.from_numpy(reference))


def _tiny(path, qtypes):
    return write_tiny_llama(path, qtypes=qtypes)


def test_gguf_model_kept_quantised_equals_dense(tmp_path):
    names = {f"blk.{i}.{t}.weight" for i in range(2) for t in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                               "ffn_gate", "ffn_up", "ffn_down")}
    qtypes = {n: Q.Q4_1 for n in names} | {"token_embd.weight": Q.Q8_0, "blk.1.attn_output.weight": Q.Q4_0}
    path = tmp_path / "tiny.gguf"
    _tiny(path, qtypes)
    dense, _ = load_gguf(path, with_tokenizer=False)
    quant, tok = load_gguf(path, quant="gguf")
    layers = {n: m for n, m in quant.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 2 * 4 + 1  # qkv, out, up, down per block + the (tied) head
    for name, layer in layers.items():
        assert torch.equal(layer.dequantize(), dense.get_submodule(name).weight), name
    assert layers["lm_head.proj"].bits == 8 and layers["stack.blocks.0.attn.qkv"].bits == 4
    assert isinstance(quant.stack.embed.tok, QuantEmbedding)
    assert not any(p.numel() > 128 for p in quant.parameters())  # nothing large kept in fp32
    ids = torch.tensor([tok.encode("the quick brown fox then the end")])
    with torch.no_grad():
        a, b = dense(ids), quant(ids)
    assert float((a - b).abs().max()) <= 1e-4 * float(a.abs().max())

    # `perplexity --quant gguf --json` records the scheme asked for, not the bits of whichever layer comes first
    # (here the int8 head)
    from seqlab.cli import main

    (tmp_path / "t.txt").write_text("the quick brown fox then the end\n" * 3)
    assert main(["perplexity", "--gguf", str(path), "--quant", "gguf", "--file", str(tmp_path / "t.txt"), "--window",
                 "16", "--json", str(tmp_path / "p.json")]) == 0
    result = json.loads((tmp_path / "p.json").read_text())
    assert result["quant"] == "gguf" and "int4" in result["quant_layers"] and "int8" in result["quant_layers"]


def test_types_without_a_layout_are_dequantised_with_a_message(tmp_path):
    path = tmp_path / "mixed.gguf"
    _tiny(path, {"blk.0.attn_q.weight": Q.Q4_1, "blk.0.attn_k.weight": Q.Q8_0, "blk.0.ffn_up.weight": Q.Q5_0})
    with pytest.warns(UserWarning, match=r"blk\.0\.attn_k\.weight \(Q8_0\).*blk\.0\.ffn_up\.weight \(Q5_0\)"):
        model, _ = load_gguf(path, quant="gguf", with_tokenizer=False)
    dense, _ = load_gguf(path, with_tokenizer=False)
    assert not isinstance(model.stack.blocks[0].attn.qkv, QuantLinear)  # q/k/v mix types: kept dense
    assert torch.equal(model.stack.blocks[0].attn.qkv.weight, dense.stack.blocks[0].attn.qkv.weight)


def test_unknown_quant_choice_is_refused(tmp_path):
    path = tmp_path / "t.gguf"
    _tiny(path, {})
    with pytest.raises(ValueError, match="quant='int3'"):
        load_gguf(path, quant="int3")


def test_quantised_load_does_not_import_dynamo(tmp_path):
    """torch's Python meta kernels (cat, normal_, the rotary table's ops) import torch._dynamo and sympy: about
    65 MiB of RSS for the life of the process. A quantised GGUF load keeps to C++ kernels (a fresh process)."""
    path = tmp_path / "tiny.gguf"
    _tiny(path, {f"blk.{i}.{t}.weight": Q.Q4_1 for i in range(2) for t in ("attn_q", "attn_k", "attn_v")})
    code = ("import sys; from seqlab.io import load_gguf; "
            f"load_gguf({str(path)!r}, quant='gguf', with_tokenizer=False); "
            "bad = sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules); assert not bad, bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]

"""A quantised decoder: every linear converted, KV-cache decoding equal to recomputation, checkpoints guarded."""
from __future__ import annotations

import json

import pytest
import torch

from seqlab.generate.engine import decode_step, prefill
from seqlab import ModelConfig, build_model
from seqlab.generate import generate
from seqlab.io import load_pretrained, save_pretrained
from seqlab.quant import QuantEmbedding, QuantLinear, quantize, quantized_bytes
from seqlab.quant.checkpoint import save_quantized
from seqlab.runtime import CheckpointError
from tests.quant.conftest import tiny_decoder


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32), (4, 128)])
def test_every_linear_is_quantised_and_logits_stay_close(bits, group):
    dense = tiny_decoder(bias=True)
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        ref = dense(ids)
    model = quantize(tiny_decoder(bias=True), bits=bits, group_size=group)
    assert not any(type(m) is torch.nn.Linear or type(m).__name__ == "Linear" for m in model.modules())
    assert isinstance(model.lm_head.proj, QuantLinear) and model.lm_head.proj.bits == 8
    assert isinstance(model.stack.embed.tok, QuantEmbedding)
    assert quantized_bytes(model) < quantized_bytes(dense) / (3 if bits == 8 else 4)
    with torch.no_grad():
        out = model(ids)
    rel = float((out - ref).abs().max() / ref.abs().max())
    assert rel < (0.02 if bits == 8 else 0.15), rel


def test_group_size_not_dividing_names_the_layer():
    model = tiny_decoder(d_ff=96)  # mlp.down has 96 inputs
    with pytest.raises(ValueError, match=r"stack\.blocks\.0\.mlp\.down: group size 64 does not divide"):
        quantize(model, bits=4, group_size=64)
    assert type(model.stack.blocks[0].attn.qkv) is not QuantLinear  # nothing changed before the error


def test_decoding_never_dequantises_a_whole_table(monkeypatch):
    """new_cache, prefill and decode steps read the quantised rows they need; a whole-table dequantisation (the
    embedding's ``weight`` property: 113 MiB for SmolLM2's vocabulary) would be a transient as big as the model."""
    model = quantize(tiny_decoder(), bits=4, group_size=32)

    def refuse(self, *args, **kwargs):
        raise AssertionError("a quantised layer was dequantised whole")

    monkeypatch.setattr(QuantLinear, "dequantize", refuse)
    with torch.inference_mode():
        cache = model.new_cache(1, 16)
        assert cache.k[0].dtype == torch.float32
        token = prefill(model, torch.tensor([[3, 5, 7]]), cache).argmax(-1)
        decode_step(model, token, cache)


def _greedy_with_cache(model, prompt, n):
    cache = model.new_cache(prompt.shape[0], 64)
    logits = [prefill(model, prompt, cache)]
    tokens = []
    for _ in range(n):
        tokens.append(logits[-1].argmax(-1))
        logits.append(decode_step(model, tokens[-1], cache))
    return torch.stack(tokens, 1), torch.stack(logits[:-1], 1)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("batch", [1, 3])
def test_cached_greedy_decoding_equals_recomputation(bits, batch):
    model = quantize(tiny_decoder(seed=3), bits=bits)
    prompt = torch.randint(0, 96, (batch, 7))
    with torch.no_grad():
        tokens, cached = _greedy_with_cache(model, prompt, 12)
        full = model(torch.cat([prompt, tokens], 1))[:, prompt.shape[1] - 1 : -1]
    # the cached path multiplies 1..batch rows, recomputation 19*batch rows: maybe other routes, same weights
    assert float((cached - full).abs().max()) <= 1e-4 * float(full.abs().max())
    top2 = full.topk(2, -1).values
    decisive = (top2[..., 0] - top2[..., 1]) > 1e-3 * full.abs().amax(-1)
    assert bool((tokens == full.argmax(-1))[decisive].all())


def test_checkpoint_round_trip(tmp_path):
    model = quantize(tiny_decoder(bias=True), bits=4, group_size=64)
    save_quantized(model, tmp_path / "q")
    back = load_pretrained(tmp_path / "q")
    ids = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
    assert back.config.extra["quant"] == model.config.extra["quant"]


def test_altered_or_truncated_checkpoint_is_refused(tmp_path):
    folder = save_quantized(quantize(tiny_decoder(), bits=4), tmp_path / "q")
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x10
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="truncated or altered"):
        load_pretrained(folder)
    weights.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CheckpointError, match="truncated or altered"):
        load_pretrained(folder)
    doc = json.loads((folder / "config.json").read_text())
    del doc["quant"]["sha256"]
    (folder / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="'quant' must hold"):
        load_pretrained(folder)


def test_a_quantised_model_runs_a_plain_forward_refuses_training_and_a_second_quantize(tmp_path):
    """A quantised model is for inference: model(ids) outside no_grad used to raise (its norms still required
    grad, so the activations did); training still must. Quantising it again found no nn.Linear, erased the recorded
    layout and saved a folder nothing could load; save_pretrained wrote one load_pretrained refused."""
    model = quantize(tiny_decoder(), bits=8)
    ids = torch.randint(0, 96, (1, 10))
    assert model(ids).shape == (1, 10, 96)
    norm = next(p for name, p in model.named_parameters() if "norm" in name)
    norm.requires_grad_(True)  # someone tries to train what is left
    with pytest.raises(RuntimeError, match="gradients cannot flow through an integer weight"):
        model(ids)
    norm.requires_grad_(False)
    with pytest.raises(ValueError, match="already quantised"):
        quantize(model, bits=4)
    assert model.config.extra["quant"]["layers"]
    save_pretrained(model, tmp_path / "q")
    torch.testing.assert_close(load_pretrained(tmp_path / "q")(ids), model(ids), rtol=0, atol=0)


def test_generating_with_an_encoder_is_a_clear_error():
    encoder = build_model(ModelConfig(arch="encoder", vocab_size=50, d_model=16, n_layers=1, n_heads=2))
    with pytest.raises(ValueError, match="this model is an encoder"):
        generate(encoder, torch.tensor([[1, 2, 3]]))

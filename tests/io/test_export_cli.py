"""``seqlab export`` on a short real run (SFT, BPE tokenizer), the way outside checks use it:

    seqlab export RUN --format hf --out DIR     -> AutoModelForCausalLM / AutoTokenizer load DIR
    seqlab export RUN --format gguf --out F.gguf -> seqlab.io.load_gguf(F.gguf) loads it

the byte tokenizer (the default of sft/dpo/seq2seq runs) written as standard files AutoTokenizer reads, and the
round trip of docs/bring-your-own-model.md ("Export"), whose training command is the fixture run here.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from seqlab.cli import build_parser  # noqa: E402
from seqlab.cli.model_args import load_model, prompt_ids  # noqa: E402
from seqlab.data.tokenizers import ByteTokenizer, load_tokenizer  # noqa: E402
from seqlab.generate import generate  # noqa: E402
from seqlab.io import load_gguf, load_pretrained  # noqa: E402
from seqlab.data.chat_template import render_chat_template  # noqa: E402
from seqlab.train.checkpoint import latest_checkpoint  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wie heißt du? 42"}]


def seqlab(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "seqlab", *args], cwd=cwd, env=dict(os.environ),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc


DOC = Path(__file__).resolve().parents[2] / "docs" / "bring-your-own-model.md"


def doc_blocks() -> tuple[list[str], str]:
    """The Export section's shell commands (shrunk to a few training steps) and its Python snippet."""
    section = DOC.read_text().split("\n## Export\n", 1)[1]
    bash = section.split("```bash\n", 1)[1].split("```", 1)[0]
    python = section.split("```python\n", 1)[1].split("```", 1)[0]
    commands = [line.replace("--max-steps 200", "--max-steps 2 --batch-size 2 --seq-len 64 --no-progress")
                for line in bash.splitlines() if line.startswith("seqlab ")]
    return commands, python


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    """The run the docs' round trip trains (shrunk): SFT with a BPE tokenizer."""
    root = tmp_path_factory.mktemp("export_run")
    train = doc_blocks()[0][0]
    assert train.startswith("seqlab train ") and train.endswith("--out runs/chat-tiny"), train
    seqlab(*shlex.split(train)[1:], cwd=root)
    return root / "runs" / "chat-tiny"


def test_docs_round_trip_runs(sft_run, monkeypatch):
    commands, python = doc_blocks()
    root = sft_run.parent.parent
    for command in commands[1:]:
        seqlab(*shlex.split(command)[1:], cwd=root)
    assert (root / "exported" / "chat-tiny" / "tokenizer_config.json").is_file()
    monkeypatch.chdir(root)
    namespace: dict = {}
    exec(compile(python, str(DOC), "exec"), namespace)
    assert namespace["out"].shape[1] > namespace["prompt"]["input_ids"].shape[1]
    assert namespace["gguf_model"].config.extra["gguf_tensor_types"] == ["F32", "Q8_0"]


def _source(run: Path):
    ckpt = latest_checkpoint(run / "checkpoints")
    return load_pretrained(ckpt), load_tokenizer(ckpt / "tokenizer.json")


def test_hf_export_loads_in_transformers(sft_run, tmp_path):
    seqlab("export", str(sft_run), "--format", "hf", "--out", "hf", cwd=tmp_path)
    model, tok = _source(sft_run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")

    prompt = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert prompt == render_chat_template(tok.chat_template, MESSAGES, add_generation_prompt=True)
    ids = hf_tok(prompt, add_special_tokens=False).input_ids
    assert ids == tok.encode(prompt)
    assert hf_tok.decode(ids) == prompt and hf_tok.eos_token_id == tok.eos_id

    x = torch.tensor([ids])
    with torch.no_grad():
        diff = (hf(x).logits - model(x)).abs().max().item()
        assert diff < 1e-4, diff
        out = hf.generate(x, max_new_tokens=12, output_scores=True, return_dict_in_generate=True)
        mine = generate(model, x, max_new_tokens=12, eos_token_id=[tok.eos_id, tok.eot_id])
    top = torch.stack(out.scores).topk(2, dim=-1).values
    if ((top[..., 0] - top[..., 1]) > 1e-3).all():  # a 2-step model may have near-ties; skip only those
        n = out.sequences.shape[1]
        assert torch.equal(out.sequences, mine[:, :n])


def test_gguf_export_loads_in_seqlab(sft_run, tmp_path):
    seqlab("export", str(sft_run), "--format", "gguf", "--out", "m.gguf", cwd=tmp_path)
    model, tok = _source(sft_run)
    loaded, gtok = load_gguf(tmp_path / "m.gguf")
    prompt = render_chat_template(tok.chat_template, MESSAGES, add_generation_prompt=True)
    ids = tok.encode(prompt)
    assert gtok.encode(prompt, add_special_tokens=False) == ids
    assert gtok.apply_chat_template(MESSAGES, add_generation_prompt=True) == ids
    x = torch.tensor([ids])
    assert torch.equal(generate(loaded, x, max_new_tokens=12), generate(model, x, max_new_tokens=12))


def test_exports_read_a_plain_prompt_as_generate_does(sft_run, tmp_path):
    """The run's documents began with BOS, and ``seqlab generate`` gives its prompts one: each export records the
    rule (HF's add_bos_token in tokenizer.json, GGUF's tokenizer.ggml.add_bos_token), so every reader adds it too."""
    seqlab("export", str(sft_run), "--format", "hf", "--out", "hf", cwd=tmp_path)
    seqlab("export", str(sft_run), "--format", "gguf", "--out", "m.gguf", cwd=tmp_path)
    _, tok = _source(sft_run)
    want = [tok.bos_id] + tok.encode("ROMEO: speak")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")("ROMEO: speak").input_ids == want
    by_flag = {}
    for flag, where in (("--checkpoint", sft_run), ("--model", tmp_path / "hf"), ("--gguf", tmp_path / "m.gguf")):
        args = build_parser().parse_args(["generate", flag, str(where), "--prompt", "x"])
        by_flag[flag] = prompt_ids(load_model(args), "ROMEO: speak")
    assert by_flag == {"--checkpoint": want, "--model": want, "--gguf": want}


def test_checkpoint_dir_and_run_dir_export_the_same_model(sft_run, tmp_path):
    ckpt = latest_checkpoint(sft_run / "checkpoints")
    seqlab("export", str(ckpt), "--format", "hf", "--out", "a", cwd=tmp_path)
    seqlab("export", str(sft_run), "--format", "hf", "--out", "b", cwd=tmp_path)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_byte_tokenizer_files_load_in_auto_tokenizer(tmp_path):
    tok = ByteTokenizer()
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    prompt = render_chat_template(tok.chat_template, MESSAGES, add_generation_prompt=True)
    assert hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == prompt
    ids = hf_tok(prompt, add_special_tokens=False).input_ids
    assert ids == tok.encode(prompt)
    assert hf_tok.decode(ids) == prompt
    assert hf_tok.convert_tokens_to_ids("<|im_end|>") == tok.eot_id and hf_tok.pad_token_id == tok.pad_id

"""Bad input, table-driven: every case exits with a usage error and one stderr line, and loses nothing.

Each case runs ``python -m seqlab ARGS`` in a fresh process (the way a user meets it), then asserts:
the exit code (2 for usage errors), a single stderr line containing ``expect`` (the field, flag or file
that is wrong), no traceback, and that every file of an existing run directory is byte-identical.
Cases are grouped by command; each group's table is a plain list, so a new case is one line.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Case:
    id: str
    args: list[str]            # after ``python -m seqlab``; "{tmp}" and "{run}" are substituted
    expect: str                # a substring the single stderr line must contain
    rc: int = 2
    setup: str | None = None   # name of a fixture-like setup function below, run before the command
    files: dict[str, str] = field(default_factory=dict)   # extra files to write under tmp: name -> text


def _snapshot(root: Path) -> dict[str, str]:
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def run_seqlab(args: list[str], cwd: Path, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "seqlab", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


# --- tables, one per command ------------------------------------------------------------------------------

TRAIN_CASES: list[Case] = [
]

EVAL_CASES: list[Case] = [
]

GENERATE_CASES: list[Case] = [
]

CHAT_CASES: list[Case] = [
]

NNQS_CASES: list[Case] = [
]

INFO_CASES: list[Case] = [
]

EXPORT_CASES: list[Case] = [
]

QUANT_CASES: list[Case] = [
    Case("quantize-bits-3", ["quantize", "--checkpoint", "{run}/checkpoints/step_00000002", "--bits", "3", "--out", "{tmp}/q"], "--bits 3"),
    Case("quantize-group-48", ["quantize", "--checkpoint", "{run}/checkpoints/step_00000002", "--bits", "4", "--group-size", "48", "--out", "{tmp}/q"], "unsupported group size 48"),
    Case("quantize-group-not-dividing", ["quantize", "--checkpoint", "{run}/checkpoints/step_00000002", "--bits", "4", "--group-size", "64", "--out", "{tmp}/q"], "attn.qkv: group size 64 does not divide in_features=32"),
    Case("quantize-no-checkpoint", ["quantize", "--checkpoint", "{tmp}/nope", "--bits", "8", "--out", "{tmp}/q"], "nope"),
    Case("quantize-not-gguf", ["quantize", "--gguf", "{tmp}/x.gguf", "--bits", "8", "--out", "{tmp}/q"], "not a GGUF file", files={"x.gguf": "hello, this is plainly not a model file"}),
    Case("quantized-altered", ["generate", "--checkpoint", "{tmp}/q", "--prompt", "hi"], "truncated or altered", files={"q/config.json": '{"format": "seqlab", "config": {}, "quant": {"layout": {"layers": {}}, "sha256": "00"}}', "q/model.safetensors": "not the weights"}),
    Case("perplexity-empty-text", ["perplexity", "--checkpoint", "{run}/checkpoints/step_00000002", "--file", "{tmp}/e.txt"], "the text is empty", files={"e.txt": "  \n"}),
    Case("perplexity-quant-gguf-on-checkpoint", ["perplexity", "--checkpoint", "{run}/checkpoints/step_00000002", "--quant", "gguf", "--split", "validation"], "--quant gguf keeps"),
    Case("perplexity-bad-stride", ["perplexity", "--checkpoint", "{run}/checkpoints/step_00000002", "--file", "{tmp}/t.txt", "--stride", "0"], "--stride 0", files={"t.txt": "some text"}),
    Case("generate-quant-gguf-on-checkpoint", ["generate", "--checkpoint", "{run}/checkpoints/step_00000002", "--prompt", "hi", "--quant", "gguf"], "--quant gguf keeps"),
]

SERVE_CASES: list[Case] = [
]

ALL_CASES = (TRAIN_CASES + EVAL_CASES + GENERATE_CASES + CHAT_CASES + NNQS_CASES + INFO_CASES + EXPORT_CASES
             + QUANT_CASES + SERVE_CASES)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A finished 2-step run directory that bad commands pointed at it must leave untouched."""
    root = tmp_path_factory.mktemp("tiny_run")
    run = root / "run"
    proc = run_seqlab(["train", "--preset", "tiny", "--tokenizer", "byte", "--max-steps", "2", "--batch-size", "2",
                       "--seq-len", "32", "--ckpt-interval", "2", "--no-progress", "--out", str(run)], cwd=root)
    assert proc.returncode == 0, proc.stderr
    return run


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_bad_input(case: Case, tmp_path: Path, tiny_run: Path) -> None:
    for name, text in case.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    args = [a.replace("{tmp}", str(tmp_path)).replace("{run}", str(tiny_run)) for a in case.args]
    before = _snapshot(tiny_run)
    proc = run_seqlab(args, cwd=tmp_path)
    err_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == case.rc, f"rc={proc.returncode}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(err_lines) == 1, proc.stderr
    assert case.expect in err_lines[0], err_lines[0]
    assert _snapshot(tiny_run) == before, "an existing run directory changed"

"""Bad input, table-driven: every case exits with a usage error and one stderr line, and loses nothing.

Each case runs ``seqlab ARGS`` in a fresh process (the first case of each command as ``python -m seqlab``, the way a
user meets it; the others forked from a process that has imported seqlab, ``tests/forked_cli.py``), then asserts:
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

from tests.forked_cli import ForkedCli


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

_TINY = ["--preset", "tiny", "--tokenizer", "byte", "--max-steps", "1", "--batch-size", "2", "--seq-len", "32",
         "--no-progress"]

TRAIN_CASES: list[Case] = [
    Case("train-into-existing-run", ["train", *_TINY, "--out", "{run}"], "--resume"),
    Case("train-resume-recorded-bad-field", ["train", "--out", "{tmp}/r", "--resume", "--max-steps", "3"],
         "r/config.json: TrainConfig.batch_size: must be a positive integer, got 'four'",
         files={"r/config.json": '{"train": {"batch_size": "four"}, "model": null}'}),
    Case("train-resume-and-overwrite", ["train", *_TINY, "--out", "{run}", "--resume", "--overwrite"], "--overwrite"),
    Case("train-out-is-a-file", ["train", *_TINY, "--out", "{tmp}/afile"], "is a file", files={"afile": "x"}),
    Case("train-out-under-a-file", ["train", *_TINY, "--out", "{tmp}/afile/run"], "lies under", files={"afile": "x"}),
    Case("train-out-not-writable", ["train", *_TINY, "--out", "/sys/seqlab-bad-input-run"], "not writable"),
    Case("train-device-cuda-missing", ["train", *_TINY, "--device", "cuda:99", "--out", "{tmp}/r"], "--device cuda:99"),
    Case("train-model-bogus-field", ["train", *_TINY, "--model", "bogus_key=1", "--out", "{tmp}/r"], "bogus_key"),
    Case("train-model-arch", ["train", *_TINY, "--model", "arch=encoder", "--out", "{tmp}/r"], "'arch' (from --model arch=...) cannot be set: it comes from --objective"),
    Case("train-model-extra", ["train", *_TINY, "--model", "extra=foo", "--out", "{tmp}/r"], "'extra' (from --model extra=...) cannot be set"),
    Case("generate-config-extra-not-a-dict", ["generate", "--checkpoint", "{tmp}/m", "--prompt", "hi"], "ModelConfig.extra: expected a JSON object (dict), got str", files={"m/config.json": '{"format": "seqlab", "config": {"extra": "foo"}}'}),
    Case("generate-config-extra-bad-quant", ["generate", "--checkpoint", "{tmp}/m", "--prompt", "hi"], "ModelConfig.extra: 'quant' is not a quantised layout", files={"m/config.json": '{"format": "seqlab", "config": {"extra": {"quant": 5}}}'}),
    Case("train-pack-sft", ["train", *_TINY, "--objective", "sft", "--pack", "--out", "{tmp}/r"], "--pack packs documents into rows for clm"),
    Case("train-context-below-seq-len", ["train", *_TINY, "--model", "max_seq_len=16", "--out", "{tmp}/r"], "--model max_seq_len=16 is shorter than --seq-len 32"),
    Case("train-resume-truncated-config", ["train", "--out", "{tmp}/cut", "--resume", "--no-progress"],
         "cut/config.json: line 1: not valid JSON", files={"cut/config.json": '{"train": {"objective": "clm", "seq_len":'}),
    Case("demo-time-zero", ["demo", "--time", "0", "--out", "{tmp}/demo"], "--time must be a positive finite number"),
    Case("demo-time-inf", ["demo", "--time", "inf", "--out", "{tmp}/demo"], "--time must be a positive finite number"),
]

EVAL_CASES: list[Case] = [
    Case("eval-json-under-a-file", ["eval", "{run}", "--json", "{tmp}/afile/e.json"], "lies under", files={"afile": "x"}),
    Case("eval-json-is-a-directory", ["eval", "{run}", "--json", "{tmp}"], "is a directory"),
    Case("eval-device-cuda-missing", ["eval", "{run}", "--device", "cuda:99"], "--device cuda:99"),
    Case("eval-no-checkpoint", ["eval", "{tmp}"], "no model here"),
    Case("eval-split-test", ["eval", "{run}", "--split", "test"], "no separate test split"),
]

GENERATE_CASES: list[Case] = [
    Case("generate-config-type", ["generate", "--checkpoint", "{tmp}/m", "--prompt", "hi"], "ModelConfig.n_kv_heads", files={"m/config.json": '{"format": "seqlab", "config": {"n_kv_heads": "2"}}'}),
    Case("generate-config-no-config", ["generate", "--checkpoint", "{tmp}/m", "--prompt", "hi"], 'no "config" object', files={"m/config.json": '{"format": "seqlab"}'}),
    Case("generate-hf-llama-no-hidden-size", ["generate", "--checkpoint", "{tmp}/m", "--prompt", "hi"], "required key 'hidden_size' is missing", files={"m/config.json": '{"model_type": "llama", "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 16}'}),
    Case("generate-truncated-config", ["generate", "--checkpoint", "{tmp}/m", "--prompt", "hi"], "m/config.json: line 1", files={"m/config.json": '{"format": "seqlab", "config": {'}),
    Case("generate-empty-folder", ["generate", "--checkpoint", "{tmp}", "--prompt", "hi"], "no model here"),
    Case("generate-json-under-file", ["generate", "--checkpoint", "{run}", "--prompt", "hi", "--json", "{tmp}/f/out.json"], "is a file", files={"f": "x"}),
    Case("generate-json-is-dir", ["generate", "--checkpoint", "{run}", "--prompt", "hi", "--json", "{tmp}"], "is a directory"),
    Case("generate-draft-with-strategy-sample", ["generate", "--checkpoint", "{run}", "--draft", "{run}", "--prompt", "hi", "--strategy", "sample"], "--draft runs speculative decoding"),
    Case("generate-device-cuda", ["generate", "--checkpoint", "{run}", "--prompt", "hi", "--device", "cuda:99"], "--device cuda:99"),
    Case("generate-bad-gguf", ["generate", "--gguf", "{tmp}/x.gguf", "--prompt", "hi"], "not a GGUF file", files={"x.gguf": "this is not a gguf file, just some words in it"}),
    Case("generate-max-new-tokens-zero", ["generate", "--checkpoint", "{run}", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    Case("generate-system-without-chat", ["generate", "--checkpoint", "{run}", "--prompt", "hi", "--system", "be brief"], "--system is the system prompt of --chat"),
    Case("generate-greedy-with-temperature", ["generate", "--checkpoint", "{run}", "--prompt", "hi", "--strategy", "greedy", "--temperature", "0.7"], "--strategy greedy takes the likeliest token"),
    Case("train-two-warmups", ["train", "--out", "{tmp}/r", "--warmup-steps", "4", "--warmup-frac", "0.25"], "--warmup-steps and --warmup-frac both set the warmup"),
    Case("train-constant-schedule-with-floor", ["train", "--out", "{tmp}/r", "--schedule", "constant", "--min-lr-ratio", "0.5"], "--schedule constant never decays"),
    Case("generate-length-penalty-without-beams", ["generate", "--checkpoint", "{run}", "--prompt", "hi", "--length-penalty", "2.5"], "--length-penalty ranks finished beams"),
    Case("generate-default-length-penalty-without-beams", ["generate", "--checkpoint", "{run}", "--prompt", "hi", "--length-penalty", "1.0"], "--length-penalty ranks finished beams"),
    Case("generate-speculative-tokens-without-draft", ["generate", "--checkpoint", "{run}", "--prompt", "hi", "--num-speculative-tokens", "9"], "--num-speculative-tokens sets what a --draft model proposes"),
    Case("generate-temperature-zero-with-top-k", ["generate", "--checkpoint", "{run}", "--prompt", "hi", "--temperature", "0", "--top-k", "3"], "--temperature 0 is greedy decoding"),
    Case("generate-sample-at-temperature-zero", ["generate", "--checkpoint", "{run}", "--prompt", "hi", "--strategy", "sample", "--temperature", "0"], "--strategy sample with --temperature 0"),
    Case("generate-prompts-file-missing", ["generate", "--checkpoint", "{run}", "--prompts-file", "{tmp}/nope.txt"], "nope.txt: file not found"),
]

CHAT_CASES: list[Case] = [
    Case("chat-empty-message", ["chat", "--checkpoint", "{run}", "--message", "  "], "--message is empty"),
    Case("chat-greedy-with-top-k", ["chat", "--checkpoint", "{run}", "--message", "hi", "--temperature", "0", "--top-k", "5"], "--temperature 0 is greedy decoding"),
    Case("chat-max-new-tokens-beyond-context", ["chat", "--checkpoint", "{run}", "--message", "hi", "--max-new-tokens", "100000"], "does not fit the model's context of"),
    Case("chat-device-cuda", ["chat", "--checkpoint", "{run}", "--message", "hi", "--device", "cuda:99"], "--device cuda:99"),
    Case("chat-config-type", ["chat", "--checkpoint", "{tmp}/m", "--message", "hi"], "ModelConfig.n_kv_heads", files={"m/config.json": '{"format": "seqlab", "config": {"n_kv_heads": "2"}}'}),
    Case("chat-missing-model-folder", ["chat", "--model", "{tmp}/nope", "--message", "hi"], "nope/config.json: file not found"),
    Case("chat-bad-gguf", ["chat", "--gguf", "{tmp}/x.gguf", "--message", "hi"], "not a GGUF file", files={"x.gguf": "this is not a gguf file, just some words in it"}),
    Case("chat-gguf-is-a-folder", ["chat", "--gguf", "{run}", "--message", "hi"], "a folder, not a GGUF file"),
    Case("embed-zero-max-length", ["embed", "hello", "--max-length", "0"], "--max-length must be >= 2"),
    Case("embed-max-length-past-context", ["embed", "hello", "--max-length", "600"], "--max-length 600 exceeds the model's context (512"),
]

NNQS_CASES: list[Case] = [
    Case("nnqs-negative-warmup", ["nnqs", "--molecule", "h2", "--warmup", "-1", "--out", "{tmp}/o"], "--warmup must be >= 0"),
    Case("nnqs-negative-anneal", ["nnqs", "--molecule", "h2", "--anneal", "-0.1", "--out", "{tmp}/o"], "--anneal must be >= 0"),
    Case("nnqs-max-batch-0", ["nnqs", "--molecule", "h2", "--max-batch", "0", "--out", "{tmp}/o"], "--max-batch must be >= 1"),
    Case("nnqs-samples-0", ["nnqs", "--molecule", "h2", "--samples", "0", "--out", "{tmp}/o"], "--samples must be a positive integer"),
    # these three were refused only after the SCF, the references and the warm-start fit
    Case("nnqs-samples-past-2-53", ["nnqs", "--molecule", "h2", "--estimator", "sampled", "--samples", "1e17", "--out", "{tmp}/o"],
         "--samples must be a positive integer of at most 2^53, got 1e+17"),
    Case("nnqs-samples-final-below", ["nnqs", "--molecule", "h2", "--samples", "1e4", "--samples-final", "1e3", "--out", "{tmp}/o"],
         "--samples-final must be >= --samples (10000): the ramp grows, got 1000"),
    Case("nnqs-lbfgs-sampled", ["nnqs", "--molecule", "h2", "--estimator", "sampled", "--lbfgs-steps", "5", "--out", "{tmp}/o"],
         "--lbfgs-steps needs a summed energy"),
    Case("nnqs-heads-not-dividing", ["nnqs", "--molecule", "h2", "--heads", "3", "--out", "{tmp}/o"], "--heads 3 must divide --d-model 64"),
    Case("nnqs-exact-tail-1", ["nnqs", "--molecule", "h2", "--exact-tail", "1", "--out", "{tmp}/o"], "--exact-tail must be in [0, 1)"),
    Case("nnqs-exact-max-0", ["nnqs", "--molecule", "h2", "--exact-max-configs", "0", "--out", "{tmp}/o"], "--exact-max-configs must be >= 1"),
    Case("nnqs-min-lr-ratio-0", ["nnqs", "--molecule", "h2", "--min-lr-ratio", "0", "--out", "{tmp}/o"], "--min-lr-ratio must be in (0, 1]"),
    Case("nnqs-beta2-1", ["nnqs", "--molecule", "h2", "--beta2", "1", "--out", "{tmp}/o"], "--beta2 must be in (0, 1)"),
    Case("nnqs-phase-lr-scale-0", ["nnqs", "--molecule", "h2", "--phase-lr-scale", "0", "--out", "{tmp}/o"], "--phase-lr-scale must be > 0"),
    Case("nnqs-negative-rollback-tol", ["nnqs", "--molecule", "h2", "--rollback-tol", "-1", "--out", "{tmp}/o"], "--rollback-tol must be >= 0"),
    Case("nnqs-out-is-a-file", ["nnqs", "--molecule", "h2", "--out", "{tmp}/f"], "is a file, not a directory", files={"f": "x"}),
    Case("nnqs-out-under-a-file", ["nnqs", "--molecule", "h2", "--out", "{tmp}/f/run"], "lies under", files={"f": "x"}),
    Case("nnqs-out-not-writable", ["nnqs", "--molecule", "h2", "--out", "/sys/seqlab-nnqs-out"], "not writable"),
    Case("nnqs-tensorboard-is-a-file", ["nnqs", "--molecule", "h2", "--out", "{tmp}/o", "--tensorboard", "{tmp}/f"], "--tensorboard", files={"f": "x"}),
    Case("nnqs-out-holds-a-run", ["nnqs", "--molecule", "h2", "--out", "{run}"], "use --resume to continue it"),
    Case("nnqs-resume-and-overwrite", ["nnqs", "--molecule", "h2", "--out", "{run}", "--resume", "--overwrite"], "contradict"),
    Case("nnqs-resume-a-train-run", ["nnqs", "--molecule", "h2", "--no-cc", "--no-fci", "--out", "{run}", "--resume"], "not a seqlab-nnqs-checkpoint"),
    Case("nnqs-xyz-bad-line", ["nnqs", "--xyz", "{tmp}/m.xyz"], "m.xyz:4: 'H 0 0 x': coordinates must be numbers", files={"m.xyz": "2\nc\nH 0 0 0\nH 0 0 x\n"}),
    Case("nnqs-xyz-short", ["nnqs", "--xyz", "{tmp}/m.xyz"], "m.xyz:4: file ends after 1 atoms", files={"m.xyz": "2\nc\nH 0 0 0\n"}),
    Case("nnqs-xyz-missing", ["nnqs", "--xyz", "{tmp}/none.xyz"], "none.xyz: cannot read it"),
    Case("nnqs-unit-with-builtin", ["nnqs", "--molecule", "h2", "--unit", "bohr", "--out", "{tmp}/o"], "built-in molecules are in Angstrom"),
    Case("nnqs-exact-sum-past-the-fast-path", ["nnqs", "--molecule", "h2o", "--basis", "6-31g", "--estimator", "exact-sum", "--out", "{tmp}/o"], "this one has 1656369); use 'selected-sum', 'sampled' or 'auto'"),
    Case("nnqs-unknown-molecule", ["nnqs", "--molecule", "benzene", "--out", "{tmp}/o"], "known molecules: h2, lih"),
]

INFO_CASES: list[Case] = [
    Case("info-empty-folder", ["info", "{tmp}"], "no model here"),
    Case("info-missing-path", ["info", "{tmp}/nope"], "no such file or directory"),
    Case("info-no-config-object", ["info", "{tmp}/m"], 'no "config" object', files={"m/config.json": '{"format": "seqlab"}'}),
    Case("info-truncated-config", ["info", "{tmp}/m"], "m/config.json: line 1", files={"m/config.json": '{"format": "seqlab", "config": {'}),
    Case("info-neither-format", ["info", "{tmp}/m"], "neither a seqlab config", files={"m/config.json": '{"hello": 1}'}),
    Case("info-unknown-field", ["info", "{tmp}/m"], "ModelConfig.bogus: unknown field", files={"m/config.json": '{"format": "seqlab", "config": {"bogus": 1}}'}),
]

EXPORT_CASES: list[Case] = [
    Case("export-missing-source", ["export", "{tmp}/nope", "--format", "hf", "--out", "{tmp}/o"], "nope: no such file or directory"),
    Case("export-run-never-checkpointed", ["export", "{tmp}/early", "--format", "hf", "--out", "{tmp}/o"], "a training run with no checkpoint yet", files={"early/config.json": '{"model": {}, "train": {}}', "early/metrics.jsonl": ""}),
    Case("export-run-without-checkpoint", ["export", "{tmp}/empty", "--format", "hf", "--out", "{tmp}/o"], "no checkpoint yet", files={"empty/checkpoints/readme.txt": "x"}),
    Case("export-not-a-model-folder", ["export", "{tmp}/notes", "--format", "hf", "--out", "{tmp}/o"], "notes: no model here", files={"notes/readme.txt": "x"}),
    Case("export-corrupt-config", ["export", "{tmp}/bad", "--format", "hf", "--out", "{tmp}/o"], "config.json: line 1: not valid JSON", files={"bad/config.json": "{oops"}),
    Case("export-checkpoint-missing-weights", ["export", "{tmp}/ck", "--format", "hf", "--out", "{tmp}/o"], "model.safetensors: missing from checkpoint", files={"ck/state.json": '{"format": "seqlab-train-checkpoint", "version": 1, "files": {"model.safetensors": "00"}}', "ck/config.json": '{"format": "seqlab", "config": {}}'}),
    Case("export-unknown-hf-model-type", ["export", "{tmp}/hf", "--format", "hf", "--out", "{tmp}/o"], "model_type 'mamba'", files={"hf/config.json": '{"model_type": "mamba"}'}),
    Case("export-hf-inexpressible", ["export", "{tmp}/enc", "--format", "hf", "--out", "{tmp}/o"], "ModelConfig.pos='rope'", files={"enc/config.json": '{"format": "seqlab", "config": {"arch": "encoder"}}'}),
    Case("export-gguf-not-llama", ["export", "{tmp}/g", "--format", "gguf", "--out", "{tmp}/g.gguf"], "ModelConfig.pos='learned'", files={"g/config.json": '{"format": "seqlab", "config": {"pos": "learned", "norm": "layernorm", "mlp": "gelu", "bias": true}}'}),
    Case("export-gguf-qwen3-with-bias", ["export", "{tmp}/q", "--format", "gguf", "--out", "{tmp}/q.gguf"], "GGUF qwen3: ModelConfig.qkv_bias=True", files={"q/config.json": '{"format": "seqlab", "config": {"qk_norm": true, "qkv_bias": true}}'}),
    Case("export-gguf-out-is-folder", ["export", "{run}", "--format", "gguf", "--out", "{tmp}"], "writes one file"),
    Case("export-gguf-out-exists", ["export", "{run}", "--format", "gguf", "--out", "{run}/config.json"], "a GGUF file's name ends in .gguf"),
    Case("export-gguf-never-replaces", ["export", "{run}", "--format", "gguf", "--out", "{tmp}/old.gguf"], "export never replaces one", files={"old.gguf": "a file the user keeps"}),
    Case("export-hf-out-is-file", ["export", "{run}", "--format", "hf", "--out", "{tmp}/taken"], "writes a folder", files={"taken": "x"}),
    Case("export-hf-out-not-empty", ["export", "{run}", "--format", "hf", "--out", "{tmp}/old"], "the folder is not empty", files={"old/special_tokens_map.json": "{}"}),
    Case("export-hf-weights-type", ["export", "{run}", "--format", "hf", "--out", "{tmp}/o", "--weights", "q4_0"], "--weights q4_0 is a GGUF weight type"),
    Case("export-quantised", ["export", "{tmp}/q8", "--format", "gguf", "--out", "{tmp}/q.gguf"], "a quantised checkpoint", files={"q8/config.json": '{"format": "seqlab", "config": {"extra": {"quant": {"layers": {}}}}}'}),
]

QUANT_CASES: list[Case] = [
    Case("quantize-bits-3", ["quantize", "--checkpoint", "{run}/checkpoints/step_00000002", "--bits", "3", "--out", "{tmp}/q"], "--bits 3"),
    Case("quantize-group-48", ["quantize", "--checkpoint", "{run}/checkpoints/step_00000002", "--bits", "4", "--group-size", "48", "--out", "{tmp}/q"], "--group-size 48: int4 takes 32, 64, 128"),
    Case("quantize-out-under-a-file", ["quantize", "--checkpoint", "{run}", "--bits", "8", "--out", "{tmp}/f/q"], "f/q: lies under", files={"f": "x"}),
    Case("export-hf-out-under-a-file", ["export", "{run}", "--format", "hf", "--out", "{tmp}/f/hf"], "f/hf: lies under", files={"f": "x"}),
    Case("quantize-group-not-dividing", ["quantize", "--checkpoint", "{run}/checkpoints/step_00000002", "--bits", "4", "--group-size", "64", "--out", "{tmp}/q"], "attn.qkv: group size 64 does not divide in_features=32; a group size that divides it: 32; --group-size 32 fits every layer"),
    Case("quantize-no-checkpoint", ["quantize", "--checkpoint", "{tmp}/nope", "--bits", "8", "--out", "{tmp}/q"], "nope"),
    Case("quantize-out-not-empty", ["quantize", "--checkpoint", "{run}/checkpoints/step_00000002", "--bits", "8", "--out", "{tmp}/full"], "the folder is not empty", files={"full/keep.txt": "mine"}),
    Case("quantize-not-gguf", ["quantize", "--gguf", "{tmp}/x.gguf", "--bits", "8", "--out", "{tmp}/q"], "not a GGUF file", files={"x.gguf": "hello, this is plainly not a model file"}),
    Case("quantized-altered", ["generate", "--checkpoint", "{tmp}/q", "--prompt", "hi"], "truncated or altered", files={"q/config.json": '{"format": "seqlab", "config": {}, "quant": {"layout": {"layers": {}}, "sha256": "00"}}', "q/model.safetensors": "not the weights"}),
    Case("perplexity-empty-text", ["perplexity", "--checkpoint", "{run}/checkpoints/step_00000002", "--file", "{tmp}/e.txt"], "e.txt: file is empty", files={"e.txt": "  \n"}),
    Case("perplexity-json-is-a-folder", ["perplexity", "--checkpoint", "{run}/checkpoints/step_00000002", "--split", "validation", "--json", "{tmp}"], "--json"),
    Case("perplexity-file-is-a-folder", ["perplexity", "--checkpoint", "{run}/checkpoints/step_00000002", "--file", "{tmp}"], "a folder, not a file"),
    Case("perplexity-quant-gguf-on-checkpoint", ["perplexity", "--checkpoint", "{run}/checkpoints/step_00000002", "--quant", "gguf", "--split", "validation"], "--quant gguf keeps"),
    Case("perplexity-bad-stride", ["perplexity", "--checkpoint", "{run}/checkpoints/step_00000002", "--file", "{tmp}/t.txt", "--stride", "0"], "--stride 0", files={"t.txt": "some text"}),
    Case("generate-quant-gguf-on-checkpoint", ["generate", "--checkpoint", "{run}/checkpoints/step_00000002", "--prompt", "hi", "--quant", "gguf"], "--quant gguf keeps"),
]

SERVE_CASES: list[Case] = [
    Case("serve-shutdown-timeout-nan", ["serve", "--gguf", "{tmp}/nope.gguf", "--shutdown-timeout", "nan"], "--shutdown-timeout must be >= 0, got nan"),
    Case("serve-missing-gguf", ["serve", "--gguf", "{tmp}/nope.gguf", "--port", "0"], "nope.gguf: no such file"),
    Case("serve-missing-checkpoint", ["serve", "--checkpoint", "{tmp}/nope", "--port", "0"], "nope: no such file or directory"),
    Case("serve-not-a-gguf", ["serve", "--gguf", "{tmp}/bad.gguf", "--port", "0"], "bad.gguf", files={"bad.gguf": "not a gguf file"}),
    Case("serve-bad-port", ["serve", "--gguf", "{tmp}/bad.gguf", "--port", "70000"], "--port", files={"bad.gguf": "x"}),
    Case("serve-zero-batch", ["serve", "--gguf", "{tmp}/bad.gguf", "--max-batch", "0"], "--max-batch", files={"bad.gguf": "x"}),
    Case("serve-zero-accel-rows", ["serve", "--gguf", "{tmp}/bad.gguf", "--accel-rows", "0"], "--accel-rows must be >= 1", files={"bad.gguf": "x"}),
    Case("serve-negative-queue", ["serve", "--gguf", "{tmp}/bad.gguf", "--max-queue", "-1"], "--max-queue", files={"bad.gguf": "x"}),
]

TABLES = (TRAIN_CASES, EVAL_CASES, GENERATE_CASES, CHAT_CASES, NNQS_CASES, INFO_CASES, EXPORT_CASES, QUANT_CASES,
          SERVE_CASES)
ALL_CASES = [case for table in TABLES for case in table]
AS_PYTHON_M = {table[0].id for table in TABLES}  # one real ``python -m seqlab`` per command


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A finished 2-step run directory that bad commands pointed at it must leave untouched."""
    root = tmp_path_factory.mktemp("tiny_run")
    run = root / "run"
    proc = run_seqlab(["train", "--preset", "tiny", "--tokenizer", "byte", "--max-steps", "2", "--batch-size", "2",
                       "--seq-len", "32", "--ckpt-interval", "2", "--eval-batches", "2", "--no-progress", "--out", str(run)],
                      cwd=root)
    assert proc.returncode == 0, proc.stderr
    return run


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_bad_input(case: Case, tmp_path: Path, tiny_run: Path, forked_cli: ForkedCli) -> None:
    for name, text in case.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    args = [a.replace("{tmp}", str(tmp_path)).replace("{run}", str(tiny_run)) for a in case.args]
    before = _snapshot(tiny_run)
    proc = run_seqlab(args, cwd=tmp_path) if case.id in AS_PYTHON_M else forked_cli.run(args, cwd=tmp_path)
    err_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == case.rc, f"rc={proc.returncode}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(err_lines) == 1, proc.stderr
    assert case.expect in err_lines[0], err_lines[0]
    assert _snapshot(tiny_run) == before, "an existing run directory changed"


def test_seqlab_warnings_read_as_one_line_and_others_keep_their_form(capsys, monkeypatch):
    import warnings

    import seqlab
    from seqlab.cli import _one_line_warning

    passed_on = []
    monkeypatch.setattr(warnings, "showwarning", lambda *args: passed_on.append(args[2]))
    show = _one_line_warning("nnqs")
    ours = str(Path(seqlab.__file__).parent / "nnqs" / "warm_start.py")
    show(UserWarning("warm start: CCSD needs\n  a closed shell"), UserWarning, ours, 129)
    show(UserWarning("deprecated"), UserWarning, "/home/me/seqlab/.venv/torch/nn/functional.py", 7)
    assert capsys.readouterr().err == "seqlab nnqs: warning: warm start: CCSD needs a closed shell\n"
    assert passed_on == ["/home/me/seqlab/.venv/torch/nn/functional.py"]  # another library's: as it always is


@pytest.mark.parametrize("command", [["generate", "--checkpoint", "unread", "--prompts-file"], ["embed", "--file"]])
def test_a_prompt_file_that_is_not_utf8_is_named_with_its_line(tmp_path, command, capsys):
    """Both printed only Python's codec message ('utf-8' codec can't decode byte 0xe9 in position 9)."""
    from seqlab.cli import main
    (tmp_path / "latin.txt").write_bytes(b"hello\ncaf\xe9\n")
    assert main([*command, str(tmp_path / "latin.txt")]) == 2
    assert "latin.txt:2: not valid UTF-8 (byte 0xe9 in column 4, at byte 9 of the file)" in capsys.readouterr().err

"""``seqlab export``: write a run's model (or any seqlab / HF model folder) as a Hugging Face folder or a GGUF file.

    seqlab export runs/sft --format hf --out exported/          # AutoModelForCausalLM / AutoTokenizer load it
    seqlab export runs/sft --format gguf --out model.gguf --weights q8_0

A run directory resolves to its latest checkpoint; a checkpoint is verified (sha256 of its files) as it loads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from seqlab.cli.model_args import source_kind, use_trained_special_rule
from seqlab.config import ModelConfig
from seqlab.data.tokenizers import load_tokenizer
from seqlab.io.checkpoint import FORMAT, load_pretrained, read_config_json, resolve_checkpoint
from seqlab.io.export_gguf import WEIGHT_TYPES, check_exportable as check_gguf, export_gguf
from seqlab.io.export_hf import bare_encoder, export_hf, hf_family
from seqlab.io.hf import config_from_hf
from seqlab.runtime.files import atomic_write_text, check_not_under_a_file, check_writable_file


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", help="export a run/checkpoint as a Hugging Face folder or a GGUF file",
        description="Write the model of RUN_OR_CHECKPOINT (a training run directory: its latest checkpoint; a "
                    "checkpoint directory; or a seqlab/HF model folder) in a format other tools load: "
                    "--format hf (config.json, model.safetensors, generation_config.json, tokenizer.json, "
                    "tokenizer_config.json with the chat template) or --format gguf (llama, qwen2 or qwen3 "
                    "architecture, as the model's shape needs).")
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="run directory, checkpoint directory or model folder")
    p.add_argument("--format", required=True, choices=("hf", "gguf"), help="output format")
    p.add_argument("--out", required=True, help="output folder (hf) or .gguf file (gguf)")
    p.add_argument("--weights", choices=WEIGHT_TYPES, default="f32",
                   help="GGUF weight type (default f32); 1-D tensors stay f32")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)


def find_tokenizer(model_dir: Path):
    """The tokenizer saved beside the weights, else the run directory's (two levels up from a checkpoint)."""
    for folder in (model_dir, model_dir.parent.parent):
        if (folder / "tokenizer.json").is_file():
            return load_tokenizer(folder / "tokenizer.json")
    return None


def check_exportable(model_dir: Path, fmt: str) -> None:
    """Refuse an inexpressible configuration from config.json alone, before any weights are read."""
    path = model_dir / "config.json"
    doc = read_config_json(path)
    try:
        cfg = ModelConfig.from_dict(doc.get("config", {})) if doc.get("format") == FORMAT else config_from_hf(doc)
    except KeyError as e:
        raise ValueError(f"{path}: missing field {e}") from e
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from e
    if cfg.extra.get("quant"):
        raise ValueError(f"{model_dir}: a quantised checkpoint (seqlab quantize) exports neither to HF nor to GGUF "
                         "here; export the dense checkpoint it came from (--format gguf --weights q8_0 or q4_0 "
                         "quantises on export)")
    if fmt == "gguf":
        check_gguf(cfg)
    else:
        hf_family(cfg)


def _check_gguf_out(out: str) -> None:
    """One new file named *.gguf (loaders know a GGUF by its name), before any weights are read: an existing file
    is never replaced, since --out pointing into a run (its config, its weights) would destroy what it exports."""
    if out.endswith("/") or Path(out).is_dir():
        raise ValueError(f"--out {out}: --format gguf writes one file (e.g. model.gguf), not a folder")
    if Path(out).suffix.lower() != ".gguf":
        raise ValueError(f"--out {out}: a GGUF file's name ends in .gguf (seqlab and llama.cpp know it by that)")
    if Path(out).exists():
        raise ValueError(f"--out {out}: the file exists and export never replaces one; choose a new name or "
                         "delete it first")
    check_writable_file(out, "--out")


def run(args: argparse.Namespace) -> int:
    if args.format == "hf" and args.weights != "f32":
        raise ValueError(f"--weights {args.weights} is a GGUF weight type; --format hf writes the weights as they are")
    model_dir = resolve_checkpoint(args.source)  # a run directory means its latest checkpoint
    check_exportable(model_dir, args.format)
    if args.format == "hf" and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out}: is a file; --format hf writes a folder")
    check_not_under_a_file(args.out, "--out")
    if args.format == "hf" and Path(args.out).is_dir() and any(Path(args.out).iterdir()):
        raise ValueError(f"--out {args.out}: the folder is not empty (stale files would be read with the export); "
                         "choose a new one")
    if args.format == "gguf":
        _check_gguf_out(args.out)
    model = load_pretrained(model_dir, dtype=torch.float32)
    tokenizer = find_tokenizer(model_dir)
    if tokenizer is None:
        print(f"seqlab export: warning: no tokenizer.json next to {model_dir}; exporting the model only",
              file=sys.stderr)
    elif source_kind(model) == "seqlab":  # trained here: the exported tokenizer adds what training inputs had
        use_trained_special_rule(tokenizer, model.config.arch)
    if args.format == "hf":
        eot = tokenizer.eot_id if tokenizer is not None else None
        out = export_hf(model, args.out, eot_id=eot if eot != model.config.eos_token_id else None)
        if bare_encoder(model.config):
            print(f"seqlab export: note: {model_dir} has no MLM head (a bare BertModel); exported the encoder alone, "
                  "as BertModel", file=sys.stderr)
        if tokenizer is not None:
            tokenizer.save_pretrained(out, model_max_length=model.config.max_seq_len,
                                      segments=model.config.type_vocab_size > 1)
        sbert = Path(model_dir) / "sentence_bert_config.json"  # the sentence length an embedder was trained to (256)
        if sbert.is_file():
            atomic_write_text(Path(out) / sbert.name, sbert.read_text(encoding="utf-8"))
    else:
        out = export_gguf(model, args.out, tokenizer, weight_type=args.weights, name=Path(args.source).name)
    print(f"exported {model_dir} -> {out} ({args.format})")
    return 0

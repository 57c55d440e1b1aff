"""``seqlab info``: describe a model folder or a config (parameters, cache cost), and what the CPU acceleration
chose for it on this machine (measured on first use, cached)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from seqlab.accel import accelerate
from seqlab.accel.apply import DISABLE_ENV
from seqlab.cli.model_args import add_quant_flags, apply_quant, check_quant_flags
from seqlab.io import load_gguf, load_pretrained
from seqlab.io.gguf_file import is_gguf_file
from seqlab.quant import QuantLinear, routes
from seqlab.quant.convert import describe_layout


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="show a model's configuration and size",
                       description="Print the ModelConfig, parameter count and KV-cache bytes per token of a model folder "
                                   "or GGUF file, and the CPU routes measured for it on this machine.")
    p.add_argument("path", help="a seqlab or Hugging Face model folder (config.json + model.safetensors), a training "
                                "checkpoint, a run directory (its latest checkpoint), or a GGUF file (its weights "
                                "dense, as `seqlab generate --gguf` loads them, unless --quant)")
    add_quant_flags(p)  # the routes a quantised model runs, as `seqlab generate --quant` would quantise it
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    # by its magic, or by its name: a .gguf that is not one (an LFS pointer, a failed download) gets GGUF's own error
    gguf = is_gguf_file(path) or (path.suffix.lower() == ".gguf" and path.is_file())
    check_quant_flags(args.quant, args.group_size, may_be_quantised=not gguf)
    if gguf and args.group_size is None:  # --quant as `seqlab generate --gguf` applies it (gguf keeps the blocks)
        model = load_gguf(path, with_tokenizer=False, quant=args.quant)[0]
    else:
        model = load_gguf(path, with_tokenizer=False)[0] if gguf else load_pretrained(args.path)
        model = apply_quant(model, args.quant, str(path), args.group_size)
    cfg = model.config
    print(config_json(cfg))
    if cfg.arch == "encoder":  # no decode loop, hence no cache and no decode routes
        print(f"parameters: {parameter_count(model):,}   ({cfg.arch}: no KV cache, no decode routes)")
    else:
        cached_layers = cfg.n_decoder_layers if cfg.arch == "encoder_decoder" else cfg.n_layers  # self-attention's
        per_token = 2 * cached_layers * cfg.n_kv_heads * cfg.head_dim * 4
        print(f"parameters: {parameter_count(model):,}   kv-cache: {per_token:,} bytes/token (fp32)")
        # what `seqlab generate`/`chat` would run here by default: routes, fused decode step, bf16 prefill, timings
        plan = accelerate(model, "decode", rows=1, dtype="auto").__dict__.get("accel_plan")
        print(plan.summary() if plan is not None else f"acceleration off ({DISABLE_ENV}=0): the plain model's products")
    quantised = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if quantised:  # their products' routes are seqlab.quant's, chosen per shape and row count
        print(f"quantised products ({len(quantised)} layers; each shape's route at a decode step's one row and a "
              f"prefill's 256, timed once and cached in {routes.cache_path()}; where the prefill line above says bf16, "
              f"`dequant` multiplies in bf16):")
        print("\n".join(routes.describe(quantised)))
    return 0


def config_json(cfg) -> str:
    """The ModelConfig as JSON, a quantised model's per-layer schemes (one entry per layer: hundreds of lines) told
    in one line, as `seqlab quantize` prints them; config.json keeps them all."""
    data = cfg.to_dict()
    layers = data.get("extra", {}).get("quant", {}).get("layers")
    if isinstance(layers, dict):
        data["extra"]["quant"]["layers"] = f"{describe_layout(layers)}; each layer's entry in config.json"
    return json.dumps(data, indent=2, sort_keys=True)


def parameter_count(model) -> int:
    """The weights the model computes with: a quantised layer counts its in x out values (and bias), which are
    buffers of packed integers, not parameters."""
    quantised = sum(m.in_features * m.out_features + (m.out_features if m.bias is not None else 0)
                    for m in model.modules() if isinstance(m, QuantLinear))
    return model.num_parameters() + quantised

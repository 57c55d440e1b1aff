"""``seqlab info``: describe a model folder or a config (parameters, cache cost)."""

from __future__ import annotations

import argparse

from seqlab.accel import plan_for
from seqlab.io import load_pretrained


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="show a model's configuration and size",
                       description="Print the ModelConfig, parameter count and KV-cache bytes per token of a model folder.")
    p.add_argument("path", help="a seqlab or Hugging Face model folder (config.json + model.safetensors), a training "
                                "checkpoint, or a run directory (its latest checkpoint)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model = load_pretrained(args.path)
    cfg = model.config
    print(cfg.to_json())
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4
    print(f"parameters: {model.num_parameters():,}   kv-cache: {per_token:,} bytes/token (fp32)")
    print(plan_for(model, "decode", rows=1, dtype=None).summary())  # the routes `seqlab generate` would take here
    return 0

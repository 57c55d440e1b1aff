"""``seqlab quantize``: write an int8 / int4 copy of a model (safetensors + config) that every command can load.

The ``--quant`` switch of the commands that run a model is defined with the other model flags, in
:mod:`seqlab.cli.model_args`.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from seqlab.io import load_gguf, load_pretrained, resolve_checkpoint
from seqlab.io.gguf import GGUF_INT4_GROUP_SIZE
from seqlab.quant import quantize
from seqlab.quant.checkpoint import save_quantized
from seqlab.quant.convert import describe_layout
from seqlab.quant.schemes import INT4_GROUP_SIZES, INT8_GROUP_SIZES
from seqlab.runtime.files import check_not_under_a_file

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write an int8/int4 weight-only copy of a model",
                       description="Quantise every linear layer (LM head at int8, groups of 32) and write config.json "
                                   "+ model.safetensors (+ tokenizer.json) to --out; load it with --checkpoint.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", metavar="PATH", help="GGUF file (dequantised, then re-quantised)")
    src.add_argument("--checkpoint", metavar="DIR", help="seqlab or Hugging Face model folder")
    p.add_argument("--bits", type=int, required=True, help="8 or 4")
    p.add_argument("--group-size", type=int, default=None,
                   help="int4: 32, 64 (default; 32 for --gguf, the file's own Q4 block, as `generate --quant int4`) "
                        "or 128; int8: 32 (default; per channel where 32 does not divide a layer), 0 = per channel, "
                        "64 or 128")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.bits not in (4, 8):
        raise ValueError(f"--bits {args.bits}: unsupported bit width (supported: 8, 4)")
    allowed = INT4_GROUP_SIZES if args.bits == 4 else INT8_GROUP_SIZES
    if args.group_size is not None and args.group_size not in allowed:  # before the model is loaded
        raise ValueError(f"--group-size {args.group_size}: int{args.bits} takes {', '.join(map(str, allowed))}"
                         + (" (0 = one scale per output channel)" if args.bits == 8 else ""))
    out = check_not_under_a_file(args.out, "--out")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"--out {out}: the folder is not empty; choose a new one (nothing is overwritten)")
    if args.gguf:
        model, tokenizer = load_gguf(args.gguf)
    else:
        folder = resolve_checkpoint(args.checkpoint)  # a run's or a checkpoints folder's latest checkpoint
        model, tokenizer = load_pretrained(folder), None
        if model.config.extra.get("quant"):
            raise ValueError(f"--checkpoint {args.checkpoint}: already quantised; quantise the dense model")
    group_size = args.group_size
    if group_size is None and args.gguf and args.bits == 4:
        group_size = GGUF_INT4_GROUP_SIZE  # as `--quant int4` on the same file
    model = quantize(model, bits=args.bits, group_size=group_size)
    save_quantized(model, out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    elif args.checkpoint:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (folder / name).is_file():  # (from the folder the weights came from, not the one named)
                shutil.copyfile(folder / name, out / name)
    print(f"wrote {out}: {describe_layout(model.config.extra['quant']['layers'])}", file=sys.stderr)
    return 0

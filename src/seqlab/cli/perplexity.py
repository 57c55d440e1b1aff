"""``seqlab perplexity``: perplexity and bits per byte of a model over a whole text (sliding window)."""
from __future__ import annotations

import argparse
import json
from collections import Counter

from seqlab.cli.model_args import add_model_source, load_model
from seqlab.data.corpus import load_corpus
from seqlab.data.readers import read_text_file
from seqlab.eval.perplexity import score_text
from seqlab.quant.convert import model_layout
from seqlab.runtime import atomic_write_text
from seqlab.runtime.files import check_readable_file, check_writable_file


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("perplexity", help="perplexity and bits per byte over a text, dense or quantised",
                       description="Score every token of the text once, in a sliding window of the model's "
                                   "context (stride = half the window), and print perplexity and bits per byte.")
    add_model_source(p, auto_dtype="fp32 weights and products")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--file", metavar="TEXT", help="UTF-8 text file to score")
    text.add_argument("--split", choices=("validation", "train"), help="the embedded corpus split to score")
    p.add_argument("--window", type=int, default=None, help="tokens per window (default: the model's context)")
    p.add_argument("--stride", type=int, default=None, help="new tokens per window (default: half the window)")
    p.add_argument("--max-bytes", type=int, default=None, help="score only the first N bytes of the text")
    p.add_argument("--json", metavar="OUT", help="also write the result as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)


def _read_text(args) -> str:
    if args.split:
        text = load_corpus(args.split)
    else:
        # as training and `seqlab eval --data` read it: CRLF kept as written, a UTF-8 BOM dropped, a bad byte named
        text = read_text_file(check_readable_file(args.file, "--file"))
    if args.max_bytes is not None:
        if args.max_bytes <= 0:
            raise ValueError(f"--max-bytes {args.max_bytes}: must be positive")
        text = text.encode("utf-8")[: args.max_bytes].decode("utf-8", errors="ignore")
    if not text.strip():
        raise ValueError(f"{args.file or args.split}: the text is empty")
    return text


def run(args: argparse.Namespace) -> int:
    for flag in ("window", "stride"):
        v = getattr(args, flag)
        if v is not None and v < 2 - (flag == "stride"):
            raise ValueError(f"--{flag} {v}: too small")
    if args.json:
        check_writable_file(args.json, "--json")  # before the scoring, which can take minutes
    text = _read_text(args)
    loaded = load_model(args)
    model, tok = loaded.model, loaded.tokenizer
    score = score_text(model, tok, text, args.window, args.stride)
    stored = model.config.extra.get("quant")
    if args.quant or not stored:  # the scheme asked for (gguf: the file's own blocks), or none
        quant = args.quant
    else:  # a quantised checkpoint: the bits most of its layers were saved with (the LM head may differ)
        quant = "int%d" % Counter(spec["bits"] for spec in stored["layers"].values()).most_common(1)[0][0]
    layers = model_layout(model)  # the group sizes too: g32 and g64 differ
    result = {"perplexity": score.perplexity, "bits_per_byte": score.bits_per_byte, "tokens": score.tokens,
              "bytes": score.bytes, "quant": quant, "window": score.window, "stride": score.stride,
              **({"quant_layers": layers} if layers else {})}
    print(f"perplexity {score.perplexity:.4f}  bits/byte {score.bits_per_byte:.4f}  "
          f"({score.tokens} tokens, {score.bytes} bytes, window {score.window}, weights {layers or quant or 'dense'})")
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    return 0

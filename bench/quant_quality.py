"""Quality of the quantised schemes: SmolLM2-135M-Instruct perplexity / bits per byte on two held-out texts.

    python bench/quant_quality.py [--max-bytes 8000] [--window 512] [--demo RUN_DIR [--demo-only]]

Rows: the dense reference (the GGUF values in fp32), ``quant="gguf"`` (the file's Q4_1/Q8_0 blocks kept), int8
(groups of 32, the default, and per channel) and int4 at groups 32/64/128, re-quantised from the reference (LM
head int8 g32 in every int4 row). ``--demo RUN_DIR`` adds the model ``seqlab demo`` trained: dense, int8 and int4
g32/g64/g128, on the whole validation play (its own tokenizer and context).
Texts: the embedded validation play, and the source of Python's ``argparse`` module (another genre, shipped with
Python). Both are cut to their first ``--max-bytes`` bytes to keep the run short on a shared machine; every token
is scored once in a sliding window (``seqlab.eval.perplexity``). Also: greedy tokens of ``quant="gguf"`` against
the dense model on the chat prompts of the real-model tests. Writes ``bench/results/quant_quality.json``.
"""
from __future__ import annotations

import argparse
import argparse as argparse_module
import copy
import json
import time
from pathlib import Path

import torch

from seqlab.cli.packaged import SMOLLM2_CHATS, packaged_smollm2
from seqlab.data.corpus import load_corpus
from seqlab.eval.perplexity import score_text
from seqlab.generate import generate
from seqlab.data import load_tokenizer
from seqlab.io import load_gguf, load_pretrained, resolve_checkpoint
from seqlab.quant import quantize
from seqlab.runtime import atomic_write_text

def texts(max_bytes: int) -> dict[str, str]:
    cut = lambda t: t.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")  # noqa: E731
    return {"validation_play": cut(load_corpus("validation")),
            "argparse_source": cut(Path(argparse_module.__file__).read_text(encoding="utf-8"))}


def greedy(model, tok, new_tokens: int) -> list[list[int]]:
    out = []
    for chat in SMOLLM2_CHATS:
        ids = torch.tensor([tok.apply_chat_template(chat, add_generation_prompt=True)])
        with torch.no_grad():
            seq = generate(model, ids, max_new_tokens=new_tokens)
        out.append(seq[0, ids.shape[1]:].tolist() if torch.is_tensor(seq) else list(seq))
    return out


def demo_rows(run: str) -> dict:
    """The demo model (trained on the play's training split) scored on the whole validation play."""
    folder = resolve_checkpoint(run)
    tok = load_tokenizer(folder / "tokenizer.json")
    text = load_corpus("validation")
    rows = {}
    for name, bits, group in (("dense", None, None), ("int8 g32 (default)", 8, None), ("int4 g64", 4, 64),
                              ("int4 g32", 4, 32), ("int4 g128", 4, 128)):
        model = load_pretrained(folder)
        if bits is not None:
            try:
                model = quantize(model, bits=bits, group_size=group)
            except ValueError as e:  # a layer narrower than the group: recorded, not hidden
                rows[name] = {"not_applicable": str(e)}
                print(f"demo {name:20s} n/a: {e}", flush=True)
                continue
        s = score_text(model, tok, text)
        rows[name] = {**s.as_dict(), "bpb_change": s.bits_per_byte - rows["dense"]["bits_per_byte"] if rows else 0.0}
        print(f"demo {name:20s} ppl {s.perplexity:8.4f}  bpb {s.bits_per_byte:.4f}  "
              f"(+{rows[name]['bpb_change']:.4f} bpb)", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-bytes", type=int, default=8000)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--demo", help="a `seqlab demo` run directory: adds its model's rows")
    ap.add_argument("--demo-only", action="store_true", help="only the --demo model's rows (no SmolLM2)")
    ap.add_argument("--out", default="bench/results/quant_quality.json")
    args = ap.parse_args(argv)
    if args.demo_only:
        if not args.demo:
            ap.error("--demo-only needs --demo RUN_DIR")
        atomic_write_text(args.out, json.dumps({"demo": demo_rows(args.demo)}, indent=2) + "\n")
        return 0
    path = packaged_smollm2()
    dense, tok = load_gguf(path)
    skipped: dict[str, str] = {}
    rows = {"dense (GGUF values, fp32)": dense, "gguf (Q4_1 + Q8_0 kept)": load_gguf(path, quant="gguf")[0]}
    for bits, group in ((8, None), (8, 0), (4, 32), (4, 64), (4, 128)):
        name = f"int{bits}" + (" g32 (default)" if group is None else f" g{group}" if group else " per channel")
        try:
            rows[name] = quantize(copy.deepcopy(dense), bits=bits, group_size=group)
        except ValueError as e:  # SmolLM2's 576-wide layers take no group of 128: recorded, not hidden
            skipped[name] = str(e)
            print(f"{name}: not applicable: {e}", flush=True)
    result = {"model": str(path.name), "window": args.window, "max_bytes": args.max_bytes, "rows": {},
              "not_applicable": skipped}
    for text_name, text in texts(args.max_bytes).items():
        for name, model in rows.items():
            t0 = time.perf_counter()
            s = score_text(model, tok, text, window=args.window)
            result["rows"].setdefault(name, {})[text_name] = {**s.as_dict(), "seconds": time.perf_counter() - t0}
            print(f"{text_name:16s} {name:28s} ppl {s.perplexity:9.4f}  bpb {s.bits_per_byte:.4f}  "
                  f"({s.tokens} tokens)", flush=True)
    ref = result["rows"]["dense (GGUF values, fp32)"]
    for name, per_text in result["rows"].items():
        for t, r in per_text.items():
            r["ppl_change_pct"] = 100 * (r["perplexity"] / ref[t]["perplexity"] - 1)
            r["bpb_change"] = r["bits_per_byte"] - ref[t]["bits_per_byte"]
    dense_tokens = greedy(dense, tok, args.new_tokens)
    gguf_tokens = greedy(rows["gguf (Q4_1 + Q8_0 kept)"], tok, args.new_tokens)
    result["gguf_greedy_equal_dense"] = [a == b for a, b in zip(dense_tokens, gguf_tokens)]
    print("gguf greedy tokens equal dense per chat prompt:", result["gguf_greedy_equal_dense"])
    if args.demo:
        result["demo"] = demo_rows(args.demo)
    atomic_write_text(args.out, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

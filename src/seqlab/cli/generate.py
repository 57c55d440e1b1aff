"""``seqlab generate`` (decode prompts with a checkpoint) and ``seqlab bench`` (decode speed vs Hugging Face)."""
from __future__ import annotations

import argparse
import json
import sys

from seqlab.cli.quantize import add_quant_option, apply_quant


def add_decode_speed_options(p: argparse.ArgumentParser) -> None:
    """``--no-pack`` and ``--compile``: the two decode-speed switches ``seqlab generate`` and ``seqlab chat`` share."""
    p.add_argument("--no-pack", action="store_true",
                   help="keep the linear weights dense (by default fp32 CPU models are packed for oneDNN, which "
                        "makes decoding faster; see docs/generation.md)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (greedy/sample): faster steps after a one-off compilation "
                        "(tens of seconds to minutes; see docs/generation.md)")

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="generate text from a checkpoint (greedy, sampling, beam, speculative)",
        description="Prefill the prompt(s), then decode on a static KV cache. Prompts of a batch are left-padded. "
                    "A prompt longer than the model's context is an error unless --truncate is given "
                    "(then its last tokens are kept).")
    p.add_argument("--checkpoint", required=True, help="model folder (seqlab or Hugging Face: config.json + "
                                                       "model.safetensors [+ tokenizer.json])")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument("--prompts-file", help="one prompt per line")
    p.add_argument("--strategy", choices=("greedy", "sample", "beam", "speculative"), default=None,
                   help="default: speculative if --draft, beam if --num-beams > 1, sample if a sampling knob is set, "
                        "else greedy")
    p.add_argument("--draft", help="draft model folder for speculative decoding (same tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--num-beams", type=int, default=1)
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream", action="store_true", help="print text as it is generated (batch of one prompt)")
    p.add_argument("--truncate", action="store_true", help="keep the last tokens of an over-long prompt")
    p.add_argument("--no-bos", action="store_true", help="do not prepend the tokenizer's BOS token")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    add_decode_speed_options(p)
    add_quant_option(p)
    p.add_argument("--metrics", action="store_true", help="print TTFT, tokens/s, KV-cache bytes, peak memory")
    p.add_argument("--json", help="also write prompts, outputs and metrics to this JSON file")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)

    b = sub.add_parser(
        "bench", help="decode benchmark: seqlab vs Hugging Face generate on one random Llama-style model",
        description="Batch-1 and batch-8 decode tokens/s, TTFT for a long prompt, and the weight-streaming bound, "
                    "seqlab and HF side by side on the same weights (see docs/generation.md).")
    b.add_argument("--dtypes", default="fp32,bf16")
    b.add_argument("--batches", default="1,8")
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--ttft-prompt-len", type=int, default=512)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--layers", type=int, default=6)
    b.add_argument("--d-model", type=int, default=512)
    b.add_argument("--vocab", type=int, default=32000)
    b.add_argument("--no-hf", action="store_true", help="skip the Hugging Face side")
    b.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    b.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: process CPU time, robust when other jobs share the cores (use with --threads 1)")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--json", help="write the results here")
    b.add_argument("--debug", action="store_true")
    b.set_defaults(func=run_bench)


def _strategy(args) -> str:
    if args.strategy:
        return args.strategy
    if args.draft:
        return "speculative"
    if args.num_beams > 1:
        return "beam"
    if args.top_k or args.top_p < 1.0 or args.min_p > 0.0 or args.temperature != 1.0:
        return "sample" if args.temperature > 0 else "greedy"
    return "greedy"


def _load_tokenizer(folder):
    from pathlib import Path

    from seqlab.data.tokenizers import load_tokenizer

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no tokenizer next to the checkpoint; text prompts need one")
    return load_tokenizer(path)


def run(args: argparse.Namespace) -> int:
    import torch

    from seqlab.generate import GenerationConfig, generate_output, stream
    from seqlab.io import load_pretrained

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
        if not prompts:
            raise ValueError(f"{args.prompts_file}: no prompts (one per line)")
    else:
        prompts = args.prompt
    strategy = _strategy(args)
    if strategy == "speculative" and not args.draft:
        raise ValueError("--strategy speculative needs --draft DIR")
    if args.stream and len(prompts) > 1:
        raise ValueError("--stream prints one prompt's text; give a single --prompt")

    model = apply_quant(load_pretrained(args.checkpoint, dtype=dtype), args.quant, f"--checkpoint {args.checkpoint}")
    draft = load_pretrained(args.draft, dtype=dtype) if strategy == "speculative" else None
    tok = _load_tokenizer(args.checkpoint)
    bos = None if args.no_bos else getattr(tok, "bos_id", None)
    rows = [([bos] if bos is not None else []) + tok.encode(p) for p in prompts]
    pad = getattr(tok, "pad_id", None)
    pad = pad if pad is not None else (model.config.pad_token_id or 0)
    T = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (T - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
    eos = [e for e in dict.fromkeys([model.config.eos_token_id, getattr(tok, "eos_id", None),
                                     getattr(tok, "eot_id", None)]) if e is not None]

    cfg = GenerationConfig(
        max_new_tokens=args.max_new_tokens, do_sample=strategy in ("sample", "speculative") and args.temperature > 0,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, num_beams=args.num_beams if strategy == "beam" else 1,
        length_penalty=args.length_penalty, num_speculative_tokens=args.num_speculative_tokens,
        eos_token_id=eos, pad_token_id=pad, stop_strings=args.stop, seed=args.seed, truncate_prompt=args.truncate,
        compile=args.compile,
    )
    if strategy == "beam" and cfg.num_beams == 1:
        cfg = cfg.updated(num_beams=4)
    if not args.no_pack:  # inference only from here on: pack for the rows a decode step multiplies
        from seqlab.model import pack_for_inference

        for m in (model, draft):
            if m is not None:
                pack_for_inference(m, rows_hint=len(prompts) * cfg.num_beams)
    if args.stream:
        s = stream(model, ids, mask, cfg, draft_model=draft, tokenizer=tok)
        for chunk in s:
            sys.stdout.write(chunk.texts[0])
            sys.stdout.flush()
        sys.stdout.write("\n")
        out = s.output
        texts = [tok.decode(out.sequences[0, ids.shape[1]:].tolist())]
    else:
        out = generate_output(model, ids, mask, cfg, draft_model=draft, tokenizer=tok)
        texts = []
        for i, p in enumerate(prompts):
            new = [t for t in out.sequences[i, ids.shape[1]:].tolist()]
            text = tok.decode(new)
            texts.append(text)
            print(f"{p}{text}" if len(prompts) == 1 else f"[{i}] {p}{text}")
    m = out.metrics
    if args.metrics:
        print(m.summary(), file=sys.stderr)
    if args.json:
        from seqlab.io.checkpoint import atomic_write_text

        doc = {"strategy": strategy, "prompts": prompts, "outputs": texts, "sequences": out.sequences.tolist(),
               "metrics": m.to_dict()}
        atomic_write_text(args.json, json.dumps(doc, indent=2) + "\n")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from seqlab.generate.bench import BenchConfig, ratio_table, run_benchmark

    bc = BenchConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                     dtypes=tuple(args.dtypes.split(",")), batches=tuple(int(b) for b in args.batches.split(",")),
                     new_tokens=args.new_tokens, ttft_prompt_len=args.ttft_prompt_len, repeats=args.repeats,
                     compare_hf=not args.no_hf, compile=args.compile, clock=args.clock, threads=args.threads)
    results = run_benchmark(bc, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(ratio_table(results))
    if args.json:
        from seqlab.io.checkpoint import atomic_write_text

        atomic_write_text(args.json, json.dumps(results, indent=2) + "\n")
    return 0

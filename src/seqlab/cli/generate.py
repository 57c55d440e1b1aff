"""``seqlab generate``: decode prompts with any model (the decode benchmark is ``bench/generate_decode.py``).

Output convention, shared with ``seqlab chat``: a plain completion prints the prompt followed by its continuation
(the text reads on); with ``--chat`` the prompt is a rendered conversation, so only the reply is printed, as
``seqlab chat`` does. An encoder-decoder's output answers its source rather than continuing it: printed alone too.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings

import torch

from seqlab.accel import accelerate
from seqlab.cli.model_args import add_model_source, load_model, prompt_ids
from seqlab.data.readers import read_text_file
from seqlab.generate import GenerationConfig, generate_output, stream
from seqlab.generate.chat import end_ids, turn_end_ids
from seqlab.generate.engine import is_encoder_decoder
from seqlab.generate.text import read_on, until_eos
from seqlab.io import load_pretrained
from seqlab.quant.convert import model_layout
from seqlab.runtime import atomic_write_text
from seqlab.runtime.files import check_readable_file, check_writable_file
from seqlab.runtime.memory import keep_freed_blocks


def add_decode_speed_options(p: argparse.ArgumentParser) -> None:
    """``--no-accel`` and ``--compile``: the two decode-speed switches ``seqlab generate`` and ``seqlab chat`` share."""
    p.add_argument("--no-accel", "--no-pack", dest="no_accel", action="store_true",
                   help="run the plain model (by default the linear layers take the routes measured fastest on "
                        "this CPU, see docs/acceleration.md; --no-pack is the old name)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (greedy/sample): faster steps after a one-off compilation "
                        "(tens of seconds to minutes; see docs/generation.md)")

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="generate text from a checkpoint (greedy, sampling, beam, speculative)",
        description="Prefill the prompt(s), then decode on a static KV cache. Prompts of a batch are left-padded. "
                    "A prompt longer than the model's context is an error unless --truncate is given "
                    "(then its last tokens are kept).")
    add_model_source(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    src.add_argument("--prompts-file", help="one prompt per line")
    p.add_argument("--strategy", choices=("greedy", "sample", "beam", "speculative"), default=None,
                   help="default: speculative if --draft, beam if --num-beams > 1, sample if a sampling knob "
                        "(--temperature, --top-k, --top-p, --min-p) is set, else greedy; speculative decoding samples "
                        "only with a sampling knob, like the others")
    p.add_argument("--draft", help="draft model folder for speculative decoding (same tokenizer)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the model's chat "
                   "template and print only the reply (as `seqlab chat --message` does)")
    p.add_argument("--system", metavar="TEXT", help="system prompt for --chat")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=None, help="0 means greedy (not given: 1.0 for sampling; "
                   "with no sampling knob set, greedy decoding)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set holding this much "
                   "probability (default 1.0: all)")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--num-beams", type=int, default=None, help="beams for beam search (default 4 with --strategy "
                   "beam, else 1)")
    p.add_argument("--length-penalty", type=float, default=None, help="beam search: a finished beam's score is "
                   "its log-probability over (generated length ** this) (default 1.0)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="with --draft: tokens the draft "
                   "proposes per step (default 4)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated (batch of one prompt)")
    p.add_argument("--truncate", action="store_true", help="keep the last tokens of an over-long prompt")
    p.add_argument("--no-bos", action="store_true", help="no BOS token (seqlab checkpoints get one by default; HF and "
                   "GGUF models follow their tokenizer's add_bos_token)")
    add_decode_speed_options(p)
    p.add_argument("--metrics", action="store_true", help="print TTFT, tokens/s, KV-cache bytes, peak memory")
    p.add_argument("--json", help="also write prompts, outputs and metrics to this JSON file")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)


def _filters(args) -> bool:
    return bool(args.top_k or args.top_p < 1.0 or args.min_p > 0.0)


def _sampling_knob(args) -> bool:
    return _filters(args) or args.temperature_given


def _strategy(args) -> str:
    if args.strategy:
        return args.strategy
    if args.draft:
        return "speculative"
    if args.num_beams is not None and args.num_beams > 1:
        return "beam"
    if _sampling_knob(args):
        return "sample" if args.temperature > 0 else "greedy"
    return "greedy"


def _check_combination(args, strategy: str) -> None:
    """Flags that the chosen strategy would not use are refused, not dropped without a word."""
    if args.num_beams is not None and args.num_beams < 1:
        raise ValueError(f"--num-beams must be >= 1 (got {args.num_beams})")
    beams = args.num_beams if args.num_beams is not None else 1
    if strategy == "beam":
        if beams == 1 and args.num_beams is not None:
            raise ValueError("--strategy beam with --num-beams 1 is greedy search: give --num-beams 2 or more")
        if args.draft:
            raise ValueError("--draft runs speculative decoding, which keeps one beam: drop --draft or the beams")
        if _sampling_knob(args):
            raise ValueError("beam search is deterministic here: --temperature/--top-k/--top-p/--min-p do not apply")
        if args.stop:
            raise ValueError("beam search does not stop at --stop strings (its beams are ranked on whole sequences)")
        if args.stream:
            raise ValueError("beam search settles its text only at the end: drop --stream")
    elif beams > 1:
        raise ValueError(f"--num-beams {beams} needs beam search, not --strategy {strategy}"
                         + (" (--draft runs speculative decoding)" if args.draft else ""))
    if strategy == "speculative" and not args.draft:
        raise ValueError("--strategy speculative needs --draft DIR")
    if args.draft and strategy in ("greedy", "sample"):
        raise ValueError(f"--draft runs speculative decoding (greedy or sampled, as the other flags say): drop "
                         f"--strategy {strategy}, or drop --draft")
    if args.num_speculative_tokens is not None and strategy != "speculative":
        raise ValueError("--num-speculative-tokens sets what a --draft model proposes: add --draft DIR, or drop it")
    if args.length_penalty is not None and strategy != "beam":
        raise ValueError("--length-penalty ranks finished beams: it needs beam search (--num-beams 2 or more)")
    if args.temperature == 0 and _filters(args):
        raise ValueError("--temperature 0 is greedy decoding: --top-k/--top-p/--min-p do not apply (drop them, or "
                         "give a temperature above 0)")
    if strategy == "sample" and args.temperature == 0:
        raise ValueError("--strategy sample with --temperature 0 is greedy decoding: give a temperature above 0")
    if strategy == "greedy" and args.strategy and _sampling_knob(args) and args.temperature > 0:
        raise ValueError("--strategy greedy takes the likeliest token: --temperature/--top-k/--top-p/--min-p do not "
                         "apply (drop them, or use --strategy sample)")
    if args.system is not None and not args.chat:
        raise ValueError("--system is the system prompt of --chat: add --chat, or drop --system")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")


def run(args: argparse.Namespace) -> int:
    if args.json:
        check_writable_file(args.json, "--json")
    if args.prompts_file:
        # (read_text_file: a file that is not UTF-8 is named with its line, as training data is)
        text = read_text_file(check_readable_file(args.prompts_file, "--prompts-file"))
        prompts = [line.rstrip("\r") for line in text.split("\n") if line.strip()]
        if not prompts:
            raise ValueError(f"{args.prompts_file}: no prompts (one per line)")
    else:
        prompts = args.prompt
    # any --temperature asks for sampling (1.0 included); none leaves the choice to the other flags
    args.temperature_given, args.temperature = args.temperature is not None, (
        1.0 if args.temperature is None else args.temperature)
    strategy = _strategy(args)
    _check_combination(args, strategy)
    if args.stream and len(prompts) > 1:
        raise ValueError("--stream prints one prompt's text; give a single --prompt")

    loaded = load_model(args)
    model, tok = loaded.model, loaded.tokenizer
    draft = (load_pretrained(args.draft, dtype=next(model.parameters()).dtype, device=next(model.parameters()).device)
             if strategy == "speculative" else None)
    if args.chat:
        if not tok.chat_template:
            raise ValueError(f"{loaded.path}: --chat needs a chat template, and this model's tokenizer has none")
        system = [{"role": "system", "content": args.system}] if args.system else []
        rows = [tok.apply_chat_template(system + [{"role": "user", "content": p}], add_generation_prompt=True)
                for p in prompts]
    else:
        rows = [prompt_ids(loaded, p, bos=not args.no_bos) for p in prompts]
    eos = turn_end_ids(tok, model.config) if args.chat else end_ids(tok, model.config)
    # as Hugging Face does without a pad token: the first EOS (a special token, so no text) pads the finished rows
    pad = next((p for p in (tok.pad_id, model.config.pad_token_id, *eos) if p is not None), 0)
    T = max(len(r) for r in rows)
    context = model.config.max_seq_len
    read = min(T, context) if args.truncate else T  # (a longer prompt without --truncate is an error further on)
    extends = not is_encoder_decoder(model) and model.config.pos != "learned"  # (learned positions: an error)
    if extends and read <= context < read + args.max_new_tokens:
        warnings.warn(f"the prompt ({read} tokens) + --max-new-tokens {args.max_new_tokens} runs past the model's "
                      f"context of {context} tokens: the positions go on, but the model was not trained that far, "
                      f"and every step attends to all the tokens before it", stacklevel=1)
    ids = torch.tensor([[pad] * (T - len(r)) + r for r in rows], dtype=torch.long,
                       device=next(model.parameters()).device)
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=ids.device)

    cfg = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        do_sample=(strategy == "sample" or strategy == "speculative" and _sampling_knob(args)) and args.temperature > 0,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, num_beams=(args.num_beams or 4) if strategy == "beam" else 1,
        length_penalty=1.0 if args.length_penalty is None else args.length_penalty,
        num_speculative_tokens=4 if args.num_speculative_tokens is None else args.num_speculative_tokens,
        eos_token_id=eos, pad_token_id=pad, stop_strings=args.stop, seed=args.seed, truncate_prompt=args.truncate,
        compile=args.compile,
    )
    keep_freed_blocks()  # a prefill's layers reuse the pages the layer before freed instead of faulting in fresh ones
    if not args.no_accel:  # inference only from here on: routes for the rows a decode step multiplies
        for m in (model, draft):
            if m is not None:
                accelerate(m, "decode", rows=len(prompts) * cfg.num_beams,
                           dtype="auto" if args.dtype == "auto" else None)
    # an encoder-decoder's output is the decoder's ids after its start token, an answer to the source, not a
    # continuation of it: it is printed alone, like a chat reply
    encdec = is_encoder_decoder(model)
    first_new, alone = (1, True) if encdec else (ids.shape[1], args.chat)
    if args.stream:
        s = stream(model, ids, mask, cfg, draft_model=draft, tokenizer=tok)
        if not alone:
            sys.stdout.write(prompts[0])  # a completion reads on from its prompt, as without --stream
        for chunk in s:
            sys.stdout.write(chunk.texts[0])
            sys.stdout.flush()
        sys.stdout.write("\n")
        out = s.output
        texts = [read_on(tok, [] if encdec else rows[0][-1:], until_eos(out.sequences[0, first_new:].tolist(), eos))]
        texts = [t.strip() for t in texts] if alone else texts
    else:
        out = generate_output(model, ids, mask, cfg, draft_model=draft, tokenizer=tok)
        texts = []
        for i, p in enumerate(prompts):
            # not the padding after EOS; read on from the prompt's last token (a SentencePiece word keeps its space)
            text = read_on(tok, [] if encdec else rows[i][-1:], until_eos(out.sequences[i, first_new:].tolist(), eos))
            shown = text.strip() if alone else f"{p}{text}"  # a reply alone; a completion after its prompt
            texts.append(text.strip() if alone else text)
            print(shown if len(prompts) == 1 else f"[{i}] {shown}")
    m = out.metrics
    layers = model_layout(model)  # which quantised weights ran (None: dense)
    if args.metrics:
        print(m.summary() + (f"\nweights: {layers}" if layers else ""), file=sys.stderr)
    if args.json:
        doc = {"strategy": strategy, "prompts": prompts, "outputs": texts, "sequences": out.sequences.tolist(),
               "metrics": m.to_dict(), **({"quant_layers": layers} if layers else {})}
        atomic_write_text(args.json, json.dumps(doc, indent=2) + "\n")
    return 0

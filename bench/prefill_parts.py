"""What each piece of the accelerated prefill is worth: the 6-layer bench model's 512-token TTFT, in one process.

    .venv/bin/python bench/prefill_parts.py                 # natively and under the AVX2 caps
    .venv/bin/python bench/prefill_parts.py --isa avx2 --rounds 25
    .venv/bin/python bench/prefill_parts.py --isa avx2 --warm-decodes 5   # after some decoding

The CLI's default copy (``accelerate(..., "decode", dtype="auto")``) runs ``generate`` for one token, with each
piece the calibration installed taken out in turn (the one-pass RMSNorm/rotary/SwiGLU kernels, the attention
kernel, the prefill's product route), against HF's ``generate`` on the same weights. Variants alternate round by
round in one process, so the machine's slow phases hit all of them: only the ratios mean anything. Prints a table
and writes bench/results/prefill_parts.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from isa_matrix import add_isa_options, parent_or_child  # noqa: E402

from decode_bench import BenchConfig, build_models, default_copy  # noqa: E402
from seqlab.accel import pointwise, prefill_attention  # noqa: E402
from seqlab.generate import GenerationConfig, generate_output  # noqa: E402
from seqlab.runtime.memory import keep_freed_blocks  # noqa: E402


def measure(rounds: int, prompt_len: int, threads: int, warm_decodes: int = 0) -> dict:
    torch.set_num_threads(threads)
    keep_freed_blocks()  # as `seqlab generate` runs
    model, hf = build_models(BenchConfig(), torch.float32, with_hf=True)
    ours = default_copy(model, 1, "fp32")
    kernels, attention = pointwise.installed(ours), getattr(ours, "prefill_attention", None)
    cast = getattr(ours, "prefill_cast", None)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    one = GenerationConfig(max_new_tokens=1, eos_token_id=[])

    def variant(with_kernels: bool, with_attention: bool, with_cast: bool):
        def run():
            pointwise.uninstall(ours)
            prefill_attention.uninstall(ours)
            ours.__dict__.pop("prefill_cast", None)
            if with_kernels and kernels is not None:
                pointwise.install(ours, kernels)
            if with_attention and attention is not None:
                prefill_attention.install(ours, attention)
            if with_cast and cast is not None:
                ours.prefill_cast = cast
            return generate_output(ours, ids, None, one)
        return run

    runs = {"seqlab default": variant(True, True, True),
            "without the pointwise kernels": variant(False, True, True),
            "without the attention kernel": variant(True, False, True),
            "without the product route": variant(True, True, False),
            "hf": lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                                      pad_token_id=0)}
    for fn in runs.values():
        fn(), fn()  # warm-up
    decode = GenerationConfig(max_new_tokens=65, eos_token_id=[])
    for _ in range(warm_decodes):  # a process that has decoded before (as generate_decode.py's has by its TTFT)
        for m in (model, ours):
            generate_output(m, ids[:, :32], None, decode)
        hf.generate(ids[:, :32], attention_mask=torch.ones_like(ids[:, :32]), max_new_tokens=65, min_new_tokens=65,
                    do_sample=False, pad_token_id=0)
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    variant(True, True, True)()  # leave the copy as the calibration made it
    hf_ms = statistics.median(samples["hf"])
    rows = [{"variant": name, "ttft_ms": statistics.median(s), "min_ms": min(s),
             "hf_over_this": hf_ms / statistics.median(s), "samples_ms": s} for name, s in samples.items()]
    return {"prompt_len": prompt_len, "rounds": rounds, "threads": threads, "warm_decodes": warm_decodes,
            "installed": {"pointwise": repr(kernels), "attention": attention.label if attention else "SDPA",
                          "prefill_route": cast.label if cast else "plain"},
            "rows": rows}


def table(result: dict) -> str:
    lines = ["| variant | TTFT ms (median) | min | HF / this |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['ttft_ms']:.1f} | {r['min_ms']:.1f} | {r['hf_over_this']:.2f}x |"
              for r in result["rows"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warm-decodes", type=int, default=0,
                    help="decode 65 tokens this many times with each model first (a heap warm from decoding)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "prefill_parts.json"))
    add_isa_options(ap)
    args = ap.parse_args()
    parent_or_child(__file__, args, lambda: measure(args.rounds, args.prompt_len, args.threads, args.warm_decodes),
                    table)


if __name__ == "__main__":
    main()

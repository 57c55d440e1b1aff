"""Decode benchmark: seqlab (plain and accelerated) vs Hugging Face ``LlamaForCausalLM.generate``, same weights.

    .venv/bin/python bench/generate_decode.py                      # fp32 + bf16, batch 1 and 8, TTFT@512,
                                                                   # natively and under the AVX2 caps
    .venv/bin/python bench/generate_decode.py --isa native         # this CPU's own ISA only
    .venv/bin/python bench/generate_decode.py --compile            # also seqlab with a torch.compile'd decode step
    .venv/bin/python bench/generate_decode.py --quick              # smaller run (CI smoke)

Prints a markdown table and writes bench/results/generate_decode.json. The model is Llama-style: 6 layers,
d=512, 8 heads, SwiGLU d_ff=1408, vocab 32000, untied LM head. The weight-streaming bound (every weight matrix
times one activation row, back to back) is measured in the same run; "bound / step" is the fraction of a decode
step that is weight streaming (1.0 = no overhead at all); the TTFT rows' arithmetic bound, a prefill's FLOPs at
the square fp32 product's rate, is its compute-bound twin. Runs are interleaved and the median is reported: the
machine is shared, so compare ratios from one run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from isa_matrix import add_isa_options, parent_or_child  # noqa: E402

from decode_bench import BenchConfig, check_options, ratio_table, run_benchmark  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="defaults of 2 layers, 16 new tokens, 1 repeat and a 64-token TTFT (options given win)")
    ap.add_argument("--repeats", type=int, default=None, help="default 3")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: process CPU time, robust when other jobs share the cores (use with --threads 1)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None, help="default 6")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ttft-prompt-len", type=int, default=None, help="default 512")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face side")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "generate_decode.json"))
    add_isa_options(ap)
    args = ap.parse_args()
    check_options(ap, args, ("repeats", "new_tokens", "layers", "ttft_prompt_len", "threads"))
    defaults = dict(layers=2, new_tokens=16, repeats=1, ttft_prompt_len=64) if args.quick else \
        dict(layers=6, new_tokens=64, repeats=3, ttft_prompt_len=512)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    def measure() -> dict:
        bc = BenchConfig(dtypes=tuple(args.dtypes.split(",")), batches=tuple(int(b) for b in args.batches.split(",")),
                         new_tokens=args.new_tokens, repeats=args.repeats, compile=args.compile, clock=args.clock,
                         threads=args.threads, n_layers=args.layers, d_model=args.d_model, vocab_size=args.vocab,
                         ttft_prompt_len=args.ttft_prompt_len, compare_hf=not args.no_hf)
        return run_benchmark(bc, log=lambda s: print(s, file=sys.stderr, flush=True))

    parent_or_child(__file__, args, measure, ratio_table)  # parent: a child per ISA; child: measure and write


if __name__ == "__main__":
    main()

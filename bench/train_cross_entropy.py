"""Training's cross-entropy: torch's route (the fused-gradient CE of seqlab.objectives.loss) against seqlab's kernel.

    .venv/bin/python bench/train_cross_entropy.py                   # the loss alone; natively and under the caps
    .venv/bin/python bench/train_cross_entropy.py --step d256       # also a whole training step of the d-256 model
    .venv/bin/python bench/train_cross_entropy.py --step gpt2-small --step-rounds 4 --isa avx2

The loss alone: forward + backward of the summed CE on random [rows, vocab] logits with a tenth of the rows ignored
(``seqlab.accel.cross_entropy.time_cross_entropy``, the calibration's own probe), best of ``--rounds``, fp32 and
bf16 logits (bf16 is pointwise work here, no products: measurable on every CPU). A step: ``train_throughput``'s
seqlab+accel step in one process, with ``model.cross_entropy_kernel`` switched between the kernel and none round
by round (the order alternating), so the ratio is the loss's share alone. Prints a table and writes
bench/results/train_cross_entropy.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import train_throughput  # noqa: E402
from isa_matrix import add_isa_options, parent_or_child  # noqa: E402
from train_attention import STEP_MODELS  # noqa: E402

from seqlab.accel import accelerate  # noqa: E402
from seqlab.accel.cross_entropy import FusedCrossEntropy, available_isas, time_cross_entropy  # noqa: E402
from seqlab.runtime.cpu import native_bf16  # noqa: E402
from seqlab.runtime.memory import keep_freed_blocks  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def time_loss(rows: int, vocab: int, dtype: str, rounds: int) -> list[dict]:
    candidates = {"torch": None, **{f"seqlab ({isa})": FusedCrossEntropy({DTYPES[dtype]: isa})
                                    for isa in available_isas()}}
    best = {name: float("inf") for name in candidates}
    for _ in range(rounds):  # each call: a warm-up round and three timed ones, candidates interleaved
        for name, t in time_cross_entropy(rows, vocab, DTYPES[dtype], candidates).items():
            best[name] = min(best[name], t)
    return [{"rows": rows, "vocab": vocab, "dtype": dtype, "candidate": name, "ms": t * 1e3,
             "logits_gb_s": rows * vocab * DTYPES[dtype].itemsize / t / 1e9} for name, t in best.items()]


def time_step(model_name: str, precision: str, rounds: int) -> dict:
    """Median ms of a seqlab+accel training step with the loss kernel and without it, alternating."""
    args = types.SimpleNamespace(**STEP_MODELS[model_name], seq_len=256, batch_size=8)
    model, _, _ = train_throughput.build_pair(args)
    accelerate(model, "train", rows=args.batch_size * args.seq_len, dtype=None, seq_len=args.seq_len)
    keep_freed_blocks()
    installed = getattr(model, "cross_entropy_kernel", None)
    if installed is None:  # the calibration kept torch's route here: time the kernel anyway, to say by how much
        installed = FusedCrossEntropy({dt: available_isas()[0] for dt in DTYPES.values()})
    step = train_throughput.make_step("seqlab", model, precision, args.vocab, fused=True)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=g) for _ in range(2)]
    samples: dict[str, list[float]] = {"kernel": [], "torch": []}
    order = [("kernel", installed), ("torch", None)]
    for r in range(rounds + 1):  # round 0 warms up both
        for name, kernel in order if r % 2 else order[::-1]:
            model.cross_entropy_kernel = kernel
            t0 = time.perf_counter()
            step(batches[r % 2])
            if r:
                samples[name].append((time.perf_counter() - t0) * 1e3)
    kernel, plain = statistics.median(samples["kernel"]), statistics.median(samples["torch"])
    return {"model": model_name, "precision": precision, "installed": repr(installed), "kernel_ms": kernel,
            "torch_ms": plain, "speedup": plain / kernel, "samples_ms": samples}


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    result = {"threads": args.threads, "loss": [r for rows, vocab in shapes for dt in ("fp32", "bf16")
                                                for r in time_loss(rows, vocab, dt, args.rounds)], "steps": []}
    if args.step:
        precisions = [p for p in args.step_precisions.split(",") if p == "fp32" or native_bf16()]
        result["steps"] = [time_step(args.step, p, args.step_rounds) for p in precisions]
    return result


def table(result: dict) -> str:
    lines = [f"the loss alone (forward + backward), {result['threads']} threads", "",
             "| logits | dtype | candidate | ms | logits read, GB/s | speed-up |", "|---|---|---|---|---|---|"]
    base = {}
    for r in result["loss"]:
        key = (r["rows"], r["vocab"], r["dtype"])
        base.setdefault(key, r["ms"])
        lines.append(f"| {r['rows']} x {r['vocab']} | {r['dtype']} | {r['candidate']} | {r['ms']:.2f} | "
                     f"{r['logits_gb_s']:.1f} | {base[key] / r['ms']:.2f}x |")
    if result["steps"]:
        lines += ["", "| step | precision | with the kernel | with torch's route | speed-up |", "|---|---|---|---|---|"]
        lines += [f"| {s['model']} | {s['precision']} | {s['kernel_ms']:.1f} ms | {s['torch_ms']:.1f} ms | "
                  f"{s['speedup']:.3f}x |" for s in result["steps"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="2048x8192,2048x50257", help="comma list of ROWSxVOCAB logits")
    ap.add_argument("--rounds", type=int, default=3, help="calls of the probe (each: three timed rounds)")
    ap.add_argument("--step", choices=sorted(STEP_MODELS), default=None,
                    help="also time a whole training step of this model with the kernel and without")
    ap.add_argument("--step-rounds", type=int, default=8)
    ap.add_argument("--step-precisions", default="fp32,bf16", help="bf16 only where the CPU has it natively")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "train_cross_entropy.json"))
    add_isa_options(ap)
    args = ap.parse_args()
    parent_or_child(__file__, args, lambda: measure(args), table)


if __name__ == "__main__":
    main()

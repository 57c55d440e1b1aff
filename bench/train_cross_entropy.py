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
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from isa_matrix import add_isa_options, parent_or_child  # noqa: E402
from train_step_ab import accelerated_model, add_step_options, alternating_step_ms, step_table  # noqa: E402

from seqlab.accel.cross_entropy import FusedCrossEntropy, available_isas, time_cross_entropy  # noqa: E402
from seqlab.runtime.cpu import native_bf16  # noqa: E402

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
    model, args = accelerated_model(model_name)
    installed = getattr(model, "cross_entropy_kernel", None)
    calibration_kept = "kernel" if installed is not None else "torch"
    if installed is None:  # the calibration kept torch's route here: time the kernel anyway, to say by how much
        installed = FusedCrossEntropy({dt: available_isas()[0] for dt in DTYPES.values()})

    def using(kernel):
        return lambda: setattr(model, "cross_entropy_kernel", kernel)

    t = alternating_step_ms(model, args, precision, rounds, {"kernel": using(installed), "torch": using(None)})
    return {"model": model_name, "precision": precision, "calibration_kept": calibration_kept,
            "kernel": repr(installed), "kernel_ms": t["kernel"],
            "torch_ms": t["torch"], "speedup": t["torch"] / t["kernel"],
            "samples_ms": {"kernel": t["kernel samples"], "torch": t["torch samples"]}}


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
    return "\n".join(lines + step_table(result["steps"], "torch_ms", "torch's route"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="2048x8192,2048x50257", help="comma list of ROWSxVOCAB logits")
    ap.add_argument("--rounds", type=int, default=3, help="calls of the probe (each: three timed rounds)")
    add_step_options(ap, "cross_entropy")
    add_isa_options(ap)
    args = ap.parse_args()
    parent_or_child(__file__, args, lambda: measure(args), table)


if __name__ == "__main__":
    main()

"""Training's causal attention: SDPA against seqlab's kernels, one layer and a whole training step.

    .venv/bin/python bench/train_attention.py                  # GPT-2 small's attention; natively and under the caps
    .venv/bin/python bench/train_attention.py --step d256      # also a whole step of train_throughput's d-256 model
    .venv/bin/python bench/train_attention.py --step gpt2-small --step-rounds 3 --isa avx2

One layer: forward and backward timed apart (best of ``--rounds``, candidates interleaved), on inputs laid out as the
model lays them out ([B, T, heads, D] projections viewed as [B, heads, T, D]). A step: ``train_throughput``'s
seqlab+accel step (``accelerate(model, "train")``, fused AdamW, ``keep_freed_blocks``), in one process, with every
self-attention's ``attend`` switched between the installed kernel and SDPA round by round (the order alternating),
so that the ratio is the attention's share alone. Prints a table and writes bench/results/train_attention.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from isa_matrix import add_isa_options, parent_or_child  # noqa: E402
from train_step_ab import accelerated_model, add_step_options, alternating_step_ms, step_table  # noqa: E402

from seqlab.accel.train_attention import TrainAttention, available_isas  # noqa: E402
from seqlab.model.attention import SelfAttention  # noqa: E402
from seqlab.runtime.cpu import native_bf16  # noqa: E402

def time_layer(batch: int, length: int, heads: int, head_dim: int, rounds: int, kv_heads: int | None = None
               ) -> list[dict]:
    """Best forward and backward seconds of SDPA and of each kernel build on one layer's causal attention
    (``kv_heads`` below ``heads``: grouped-query, or multi-query at 1)."""
    kv = kv_heads or heads
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(batch, length, heads + 2 * kv, head_dim, generator=g).requires_grad_()
    grad = torch.randn(batch, heads, length, head_dim, generator=g)
    candidates = {"SDPA": F.scaled_dot_product_attention,
                  **{f"seqlab ({isa})": TrainAttention({torch.float32: isa}) for isa in available_isas()}}
    best = {name: [float("inf"), float("inf")] for name in candidates}
    for r in range(rounds + 1):  # round 0 warms up
        for name, attend in candidates.items():
            q, k, v = (t.transpose(1, 2) for t in qkv.split((heads, kv, kv), dim=2))
            t0 = time.perf_counter()
            out = attend(q, k, v, is_causal=True, enable_gqa=kv != heads)
            t1 = time.perf_counter()
            out.backward(grad)
            t2 = time.perf_counter()
            qkv.grad = None
            if r:
                best[name] = [min(best[name][0], t1 - t0), min(best[name][1], t2 - t1)]
    flop = 2 * 2 * batch * heads * length * length * head_dim / 2  # two products over the causal half
    return [{"candidate": name, "forward_ms": f * 1e3, "backward_ms": b * 1e3,
             "forward_gflops": flop / f / 1e9, "backward_gflops": 2.5 * flop / b / 1e9} for name, (f, b) in best.items()]


def time_step(model_name: str, precision: str, rounds: int) -> dict:
    """Median ms of a seqlab+accel training step with the kernel installed and with SDPA, alternating."""
    model, args = accelerated_model(model_name)
    layers = [m for m in model.modules() if isinstance(m, SelfAttention)]
    installed = layers[0].attend
    calibration_kept = "kernel" if isinstance(installed, TrainAttention) else "SDPA"
    if not isinstance(installed, TrainAttention):  # SDPA was kept here: time the kernel anyway, to say by how much
        installed = TrainAttention({torch.float32: available_isas()[0], torch.bfloat16: available_isas()[0]})

    def attending(attend):
        def switch_on():
            for m in layers:
                m.attend = attend
        return switch_on

    t = alternating_step_ms(model, args, precision, rounds,
                            {"kernel": attending(installed), "SDPA": attending(F.scaled_dot_product_attention)})
    return {"model": model_name, "precision": precision, "calibration_kept": calibration_kept,
            "kernel": repr(installed), "kernel_ms": t["kernel"],
            "sdpa_ms": t["SDPA"], "speedup": t["SDPA"] / t["kernel"],
            "samples_ms": {"kernel": t["kernel samples"], "SDPA": t["SDPA samples"]}}


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    kv = args.kv_heads or args.heads
    result = {"batch": args.batch, "length": args.length, "heads": args.heads, "kv_heads": kv,
              "head_dim": args.head_dim, "threads": args.threads,
              "layer": time_layer(args.batch, args.length, args.heads, args.head_dim, args.rounds, kv), "steps": []}
    if args.step:
        precisions = [p for p in args.step_precisions.split(",") if p == "fp32" or native_bf16()]
        result["steps"] = [time_step(args.step, p, args.step_rounds) for p in precisions]
    return result


def table(result: dict) -> str:
    kv = result.get("kv_heads", result["heads"])
    lines = [f"one layer: {result['batch']} x {result['length']} tokens, {result['heads']} heads x "
             f"{result['head_dim']}" + (f" reading {kv} kv heads" if kv != result["heads"] else "")
             + f", {result['threads']} threads", "",
             "| candidate | forward ms | backward ms | forward + backward | GFLOP/s fwd / bwd (causal half) |",
             "|---|---|---|---|---|"]
    base = result["layer"][0]["forward_ms"] + result["layer"][0]["backward_ms"]
    for r in result["layer"]:
        total = r["forward_ms"] + r["backward_ms"]
        lines.append(f"| {r['candidate']} | {r['forward_ms']:.2f} | {r['backward_ms']:.2f} | {total:.2f} ms "
                     f"({base / total:.2f}x) | {r['forward_gflops']:.0f} / {r['backward_gflops']:.0f} |")
    return "\n".join(lines + step_table(result["steps"], "sdpa_ms", "SDPA"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="key/value heads (default: --heads); fewer is grouped-query attention, 1 multi-query")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    add_step_options(ap, "attention")
    add_isa_options(ap)
    args = ap.parse_args()
    parent_or_child(__file__, args, lambda: measure(args), table)


if __name__ == "__main__":
    main()

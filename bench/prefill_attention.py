"""The prefill's causal attention alone: SDPA against each build of seqlab's kernel, by prompt length.

    .venv/bin/python bench/prefill_attention.py                       # natively and under the AVX2 caps
    .venv/bin/python bench/prefill_attention.py --isa native --lengths 512,2048 --rounds 20

One prompt, all heads, inputs laid out as the model lays them out (queries a view of the fused projection, keys and
values the cache's contiguous [B, G, T, D]); candidates interleaved round by round, best round each. The process
keeps freed blocks on the heap, as ``seqlab generate`` and ``chat`` run (the kernel's scratch then costs no page
faults). GFLOP/s count the causal half of the two products. Prints a table and writes
bench/results/prefill_attention.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).parent))
from isa_matrix import add_isa_options, parent_or_child  # noqa: E402

from seqlab.accel.calibrate import best_of_rounds  # noqa: E402
from seqlab.accel.prefill_attention import available_isas, causal_attention  # noqa: E402
from seqlab.runtime.memory import keep_freed_blocks  # noqa: E402

SHAPES = {"8 heads x 64 (6-layer model)": (8, 8, 64), "9 x 64, 3 key heads (SmolLM2)": (9, 3, 64)}


def time_shape(heads: int, kv_heads: int, head_dim: int, length: int, rounds: int) -> dict[str, float]:
    """Best seconds per call of SDPA and of each build on one ``length``-token prompt."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, length, heads + 2 * kv_heads, head_dim, generator=g)
    q, k, v = (t.transpose(1, 2) for t in qkv.split((heads, kv_heads, kv_heads), dim=2))
    k, v = k.contiguous(), v.contiguous()
    runs = {"SDPA": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)}
    for isa in available_isas():
        runs[f"seqlab ({isa})"] = lambda isa=isa: causal_attention(q, k, v, isa=isa)
    with torch.inference_mode():
        return best_of_rounds(runs, rounds, declined=lambda out: out is None)


def measure(args) -> dict:
    keep_freed_blocks()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name, (heads, kv, d) in SHAPES.items():
        for length in (int(n) for n in args.lengths.split(",")):
            flop = 2 * 2 * heads * d * length * (length + 1) / 2
            for candidate, s in time_shape(heads, kv, d, length, args.rounds).items():
                rows.append({"shape": name, "length": length, "candidate": candidate, "ms": s * 1e3,
                             "gflops": flop / s / 1e9})
    return {"threads": torch.get_num_threads(), "rounds": args.rounds, "rows": rows}


def table(result: dict) -> str:
    lines = [f"{result['threads']} threads, best of {result['rounds']} rounds", "",
             "| shape | tokens | candidate | ms | vs SDPA | GFLOP/s (causal half) |", "|---|---|---|---|---|---|"]
    sdpa = {(r["shape"], r["length"]): r["ms"] for r in result["rows"] if r["candidate"] == "SDPA"}
    for r in result["rows"]:
        if r["ms"] == float("inf"):  # every call declined (its scratch could not be allocated): no timing
            lines.append(f"| {r['shape']} | {r['length']} | {r['candidate']} | declined | - | - |")
            continue
        lines.append(f"| {r['shape']} | {r['length']} | {r['candidate']} | {r['ms']:.3f} | "
                     f"{sdpa[(r['shape'], r['length'])] / r['ms']:.2f}x | {r['gflops']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="256,512,1024,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "prefill_attention.json"))
    add_isa_options(ap)
    args = ap.parse_args()
    parent_or_child(__file__, args, lambda: measure(args), table)


if __name__ == "__main__":
    main()

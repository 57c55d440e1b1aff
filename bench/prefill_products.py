"""A 512-token prefill's weight products alone, on each library, against the square-matrix rate of the same hour.

    .venv/bin/python bench/prefill_products.py                     # SmolLM2's shapes, natively and under the caps
    .venv/bin/python bench/prefill_products.py --shapes bench6 --isa avx2

Every layer's four products (fused QKV, attention output, fused gate/up, down) at ``--rows`` rows, on random fp32
weights of the model's sizes: MKL (``F.linear``, the plain model), oneDNN reading the plain weights (the prefill's
oneDNN route, which reorders each weight on every call), and oneDNN with weights packed once (a second copy of every
weight, which seqlab does not keep). A 2048-square product in the same process gives the hour's rate. Routes
alternate pass by pass, so the machine's slow phases hit all of them. Prints a table and writes
bench/results/prefill_products.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from decode_bench import BenchConfig  # noqa: E402
from isa_matrix import add_isa_options, parent_or_child  # noqa: E402

_B = BenchConfig()
# d_model, n_heads * head_dim, 2 * n_kv_heads * head_dim, d_ff, layers
SHAPES = {"smollm2": (576, 576, 384, 1536, 30),  # SmolLM2-135M: 9 heads of 64, 3 KV heads
          "bench6": (_B.d_model, _B.d_model, 2 * _B.d_model * _B.n_kv_heads // _B.n_heads, _B.d_ff, _B.n_layers)}


def layer_products(shapes: str) -> tuple[list[tuple[int, int]], int]:
    """The (in, out) sizes of one layer's four products, and the number of layers."""
    d, q, kv, ff, layers = SHAPES[shapes]
    return [(d, q + kv), (q, d), (d, 2 * ff), (ff, d)], layers


def square_rate(n: int = 2048, reps: int = 5) -> float:
    """GFLOP/s of an n x n x n fp32 product (best of ``reps``), on the ISA this process runs."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(reps))
    return 2 * n ** 3 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(shapes: str, rows: int, passes: int, threads: int) -> dict:
    """Median ms of each route's pass over every layer's products, and the square-matrix rate after them."""
    torch.set_num_threads(threads)
    products, layers = layer_products(shapes)
    weights = [[torch.randn(n, k) * 0.02 for k, n in products] for _ in range(layers)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws] for ws in weights]
    inputs = {k: torch.randn(rows, k) for k, _ in products}

    def onednn(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    routes = {"MKL (F.linear)": (F.linear, weights), "oneDNN, plain weights": (onednn, weights),
              "oneDNN, packed once": (onednn, packed)}

    def one_pass(product, by_layer):
        for ws in by_layer:
            for (k, _), w in zip(products, ws):
                product(inputs[k], w)

    for product, by_layer in routes.values():
        one_pass(product, by_layer)  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in routes}
    for _ in range(passes):
        for name, (product, by_layer) in routes.items():
            samples[name].append(_timed(lambda: one_pass(product, by_layer)) * 1e3)
    peak = square_rate()
    gflop = 2 * rows * sum(k * n for k, n in products) * layers / 1e9
    rows_out = []
    for name, s in samples.items():
        ms = statistics.median(s)
        rows_out.append({"route": name, "ms": ms, "gflops": gflop / ms * 1e3, "of_square_rate": gflop / ms * 1e3 / peak,
                         "samples_ms": s})
    return {"shapes": shapes, "rows": rows, "threads": threads, "passes": passes, "gflop": gflop,
            "square_2048_gflops": peak, "results": rows_out}


def table(result: dict) -> str:
    lines = [f"{result['shapes']}: {result['gflop']:.1f} GFLOP at {result['rows']} rows; square 2048 product "
             f"{result['square_2048_gflops']:.0f} GFLOP/s", "",
             "| route | ms (median) | GFLOP/s | of the square rate |", "|---|---|---|---|"]
    lines += [f"| {r['route']} | {r['ms']:.1f} | {r['gflops']:.1f} | {r['of_square_rate']:.0%} |"
              for r in result["results"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--rows", type=int, default=512, help="prompt tokens (rows of each product)")
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "prefill_products.json"))
    add_isa_options(ap)
    args = ap.parse_args()
    parent_or_child(__file__, args, lambda: measure(args.shapes, args.rows, args.passes, args.threads), table)


if __name__ == "__main__":
    main()

"""A 512-token prefill's weight products alone, on each library, against the square-matrix rate of the same hour.

    .venv/bin/python bench/prefill_products.py                     # SmolLM2's shapes, natively and under the caps
    .venv/bin/python bench/prefill_products.py --shapes bench6 --isa avx2

Every layer's four products (fused QKV, attention output, fused gate/up, down) at ``--rows`` rows, on random fp32
weights of the model's sizes, on each route:

- MKL (``F.linear``, the plain model);
- oneDNN reading the plain weights (the prefill's oneDNN route, which reorders each weight on every call), and
  oneDNN with weights packed once (a second copy of every weight, which seqlab does not keep);
- MKL split by hand, one serial MKL call per core on its share of the columns (or rows): is MKL's two-thread rate
  held back by how MKL splits the work, or by the cores themselves (compare ``--threads 1``)?
- numpy's BLAS (OpenBLAS in numpy's wheels, with its own pool of a thread per core, or ``OPENBLAS_NUM_THREADS``:
  timed only where ``--threads`` is the number of cores this process may use).

``--between`` runs one of torch's elementwise ops (on OpenMP, as the prefill's norms and rotary do) before each
product, as a real prefill does: there a BLAS with a thread pool of its own meets torch's spinning threads. A
2048-square product in the same process gives the hour's rate. Routes alternate pass by pass, so the machine's slow
phases hit all of them. Prints a table and writes bench/results/prefill_products.json.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from decode_bench import BenchConfig  # noqa: E402
from isa_matrix import add_isa_options, parent_or_child  # noqa: E402
from seqlab.runtime import native  # noqa: E402

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


def per_core_products(threads: int):
    """``{name: product}`` for MKL split by hand between ``threads`` cores (columns, rows), or {} where torch has no
    MKL sgemm to call or no C compiler is here."""
    try:
        gemm = ctypes.cast(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).sgemm_,
                           ctypes.c_void_p).value
        lib = native.build_library("per_core_products", Path(__file__).with_name("per_core_products.c"))
    except (OSError, AttributeError, RuntimeError) as e:
        print(f"(no per-core MKL route: {e})")
        return {}
    lib.per_core_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5

    def product(split_cols: int):
        def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            y = torch.empty(x.shape[0], w.shape[0])
            lib.per_core_linear(gemm, x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], w.shape[0],
                                threads, split_cols)
            return y
        return run

    return {"MKL, one serial call per core (columns)": product(1), "MKL, one serial call per core (rows)": product(0)}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def numpy_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear`` on numpy's BLAS (no copies: the transposed weight is a view, which BLAS reads as such)."""
    return torch.from_numpy(np.matmul(x.numpy(), w.numpy().T))


def measure(shapes: str, rows: int, passes: int, threads: int, between: bool = False) -> dict:
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
    routes |= {name: (product, weights) for name, product in per_core_products(threads).items()}
    if threads == len(os.sched_getaffinity(0)):  # numpy's BLAS keeps its own count: a thread per core it may use
        routes["numpy's BLAS (OpenBLAS in numpy's wheels)"] = (numpy_linear, weights)
    scratch = torch.randn(rows, products[0][0])  # a hidden state's size, for --between
    x, w = inputs[products[0][0]], weights[0][0]
    for name, (product, _) in routes.items():  # every route computes the same product
        torch.testing.assert_close(product(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4, msg=name)

    def one_pass(product, by_layer):
        for ws in by_layer:
            for (k, _), w in zip(products, ws):
                if between:
                    scratch.mul_(1.0)
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
    return {"shapes": shapes, "rows": rows, "threads": threads, "passes": passes, "between": between, "gflop": gflop,
            "square_2048_gflops": peak, "results": rows_out}


def table(result: dict) -> str:
    between = ", a torch op before each product" if result.get("between") else ""
    lines = [f"{result['shapes']}: {result['gflop']:.1f} GFLOP at {result['rows']} rows on {result['threads']} thread"
             f"{'s' if result['threads'] != 1 else ''}"
             f"{between}; square 2048 product {result['square_2048_gflops']:.0f} GFLOP/s", "",
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
    ap.add_argument("--between", action="store_true", help="one torch elementwise op before each product")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "prefill_products.json"))
    add_isa_options(ap)
    args = ap.parse_args()
    parent_or_child(__file__, args, lambda: measure(args.shapes, args.rows, args.passes, args.threads,
                                                          args.between), table)


if __name__ == "__main__":
    main()

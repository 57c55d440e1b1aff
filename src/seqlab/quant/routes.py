"""Which product a quantised layer runs, chosen by timing the candidates once per shape on the running machine.

Why by measurement: the fastest way to multiply by an int4/int8 weight depends on the CPU, the thread count and
the number of activation rows. At one or a few rows (decode) the weight stream dominates and the packed kernel
wins; at hundreds of rows (prefill) the product is compute-bound, and dequantising blocks of the weight into
fp32 for oneDNN/MKL's GEMM can be faster. So each (scheme, shape, row bucket, threads) is timed once against
fp32 ``F.linear`` on the same (dequantised) weight, and the fastest quantised route is kept.

This is the interface the accelerator layer can take over: ``ROUTES`` (name -> function), :func:`time_routes`
(measure one key) and :func:`choose_route` (cached decision); :func:`set_route` pins a decision (tests, or
an accel cache loaded from disk), and :func:`route_table` lists what was measured.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from seqlab.quant import kernels

_BUCKETS = (1, 4, 8, 16, 64, 256)
_BLOCK_ROWS = 2048  # output rows dequantised at a time by the blockwise route


@dataclass(frozen=True)
class RouteKey:
    bits: int
    group_size: int
    out_features: int
    in_features: int
    rows: int  # bucket: the smallest of _BUCKETS >= the actual rows
    threads: int


def bucket(rows: int) -> int:
    return next((b for b in _BUCKETS if rows <= b), _BUCKETS[-1])


def _kernel(layer, x: Tensor) -> Tensor:
    # .float() is a no-op unless someone cast the model (model.to(bf16)); the C kernel reads fp32 scales
    scales, bias = layer.scales.float(), None if layer.bias is None else layer.bias.float()
    if layer.bits == 4:
        return kernels.int4_matmul(x, layer.qweight, scales, layer.mins.float(), layer.group_size, bias)
    return kernels.int8_matmul(x, layer.qweight, scales, layer.group_size, bias)


def _dequant_blockwise(layer, x: Tensor) -> Tensor:
    """Dequantise ``_BLOCK_ROWS`` output rows at a time (C where built, else torch) and run fp32 GEMM on each."""
    n = layer.out_features
    fast = kernels.load_kernels() is not None
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    for i in range(0, n, _BLOCK_ROWS):
        j = min(n, i + _BLOCK_ROWS)
        w = kernels.dequantize_rows(layer, i, j) if fast else layer.dequantize(slice(i, j))
        y[:, i:j] = x @ w.t()
    if layer.bias is not None:
        y += layer.bias
    return y


RouteFn = Callable[[object, Tensor], Tensor]
ROUTES: dict[str, RouteFn] = {"kernel": _kernel, "dequant": _dequant_blockwise}
_CHOSEN: dict[RouteKey, str] = {}
_TIMINGS: dict[RouteKey, dict[str, float]] = {}


def available(name: str) -> bool:
    return name != "kernel" or kernels.load_kernels() is not None


def key_for(layer, rows: int) -> RouteKey:
    return RouteKey(layer.bits, layer.group_size, layer.out_features, layer.in_features, bucket(rows),
                    torch.get_num_threads())


@torch.no_grad()
def time_routes(layer, rows: int, reps: int = 7) -> dict[str, float]:
    """Best-of-``reps`` seconds of each available route and of fp32 ``F.linear`` (``"fp32"``) at ``rows`` rows.

    The candidates are interleaved and the minimum kept, so a busy neighbour on a shared machine slows all of
    them alike instead of deciding the race. Candidates 3x slower than the best after one timing keep that time.
    """
    x = torch.randn(rows, layer.in_features)
    dense = layer.dequantize()
    fns = {"fp32": lambda: F.linear(x, dense, layer.bias)}
    fns.update({name: (lambda fn=fn: fn(layer, x)) for name, fn in ROUTES.items() if available(name)})
    best = {name: float("inf") for name in fns}
    weights = (dense, layer.qweight, layer.scales, layer.mins)
    for name, fn in fns.items():  # warm: caches, lazy builds
        fn()
    for rep in range(reps):
        if rep == 1:  # a candidate already 3x slower than the best is out: calibration stays cheap
            fastest = min(best.values())
            fns = {n: f for n, f in fns.items() if n == "fp32" or best[n] <= 3 * fastest}
        for name, fn in fns.items():
            kernels.evict(*weights)  # a decode step streams each weight from DRAM: time it cold, not from cache
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def choose_route(layer, rows: int) -> str:
    """The fastest quantised route for this layer's key (measured at the bucket's row count on first use)."""
    key = key_for(layer, rows)
    name = _CHOSEN.get(key)
    if name is None:
        timings = time_routes(layer, key.rows)
        _TIMINGS[key] = timings
        name = min((n for n in timings if n != "fp32"), key=timings.__getitem__)
        _CHOSEN[key] = name
    return name


def set_route(key: RouteKey, name: str) -> None:
    if name not in ROUTES:
        raise ValueError(f"unknown quantised route {name!r} (known: {', '.join(ROUTES)})")
    _CHOSEN[key] = name


def clear_routes() -> None:
    _CHOSEN.clear()
    _TIMINGS.clear()


def route_table() -> list[dict]:
    """Every decision so far with its timings: what a report or an accel cache stores."""
    return [{**key.__dict__, "route": _CHOSEN[key], "seconds": _TIMINGS.get(key, {})} for key in _CHOSEN]


def run_route(layer, x: Tensor) -> Tensor:
    name = choose_route(layer, x.shape[0])
    if name == "kernel" and not available("kernel"):
        name = "dequant"
    return ROUTES[name](layer, x)

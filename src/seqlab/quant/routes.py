"""Which product a quantised layer runs, chosen by timing the candidates once per shape on the running machine.

Why by measurement: the fastest way to multiply by an int4/int8 weight depends on the CPU, the thread count and
the number of activation rows. At one or a few rows (decode) the weight stream dominates and the packed kernel
wins; at hundreds of rows (prefill) the product is compute-bound, and dequantising blocks of the weight into
fp32 for oneDNN/MKL's GEMM is faster. So each (scheme, shape, row bucket) is timed once and the fastest route
kept. Decisions are cached on disk per CPU signature (model, ISA flags and caps, torch version, threads) and
kernel build, so only the first run on a machine pays for the timing (seconds at prefill sizes).

``ROUTES`` (name -> function), :func:`time_routes` (measure one key) and :func:`choose_route` (cached decision);
:func:`set_route` pins a decision (tests), and :func:`route_table` lists the decisions of this process.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import Tensor

from seqlab.quant import kernels
from seqlab.runtime import atomic_write_json
from seqlab.runtime.cpu import current_signature

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


def _kernel(isa: str) -> "Prepare":
    return lambda layer: kernels.product(layer, isa)


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


Product = Callable[[Tensor], Tensor]
Prepare = Callable[[object], Product]  # a layer -> its product function for fp32 rows
ROUTES: dict[str, Prepare] = {
    "kernel": _kernel("avx2"),       # kernel.c, 8 lanes
    "kernel512": _kernel("avx512"),  # kernel.c built for AVX-512, 16 lanes (where the CPU and its caps allow)
    "dequant": lambda layer: (lambda x: _dequant_blockwise(layer, x)),
}
_ISA = {"kernel": "avx2", "kernel512": "avx512"}
_CHOSEN: dict[RouteKey, str] = {}
_TIMINGS: dict[RouteKey, dict[str, float]] = {}
_GENERATION = [0]  # bumped whenever decisions change, so layers drop the products they prepared


def available(name: str) -> bool:
    return name not in _ISA or kernels.load_kernels(_ISA[name]) is not None


def key_for(layer, rows: int) -> RouteKey:
    return RouteKey(layer.bits, layer.group_size, layer.out_features, layer.in_features, bucket(rows),
                    torch.get_num_threads())


@torch.no_grad()
def time_routes(layer, rows: int, reps: int = 5) -> dict[str, float]:
    """Best-of-``reps`` seconds of each available route at ``rows`` rows, the weights streamed from DRAM.

    The candidates are interleaved and the minimum kept, so a busy neighbour on a shared machine slows all of
    them alike instead of deciding the race. A candidate 3x slower than the best after one timing keeps that time.
    No fp32 copy of the weight is made: that would double a quantised model's peak memory while it calibrates.
    """
    x = torch.randn(rows, layer.in_features)
    fns = {name: (lambda fn=prepare(layer): fn(x)) for name, prepare in ROUTES.items() if available(name)}
    best = {name: float("inf") for name in fns}
    weights = (layer.qweight, layer.scales, layer.mins)
    for fn in fns.values():  # warm: caches, lazy builds
        fn()
    for rep in range(reps):
        if rep == 1:  # a candidate already 3x slower than the best is out: calibration stays cheap
            fastest = min(best.values())
            fns = {n: f for n, f in fns.items() if best[n] <= 3 * fastest}
        for name, fn in fns.items():
            kernels.evict(*weights)  # a decode step streams each weight from DRAM: time it cold, not from cache
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def _disk_key(key: RouteKey) -> str:
    return f"int{key.bits}-g{key.group_size}-{key.out_features}x{key.in_features}-rows{key.rows}"


def cache_path() -> Path:
    """One file per CPU signature and kernel build: a decision measured elsewhere is never reused here."""
    builds = "-".join(isa for isa in ("avx2", "avx512") if kernels.load_kernels(isa) is not None) or "torch"
    return kernels.cache_dir() / f"quant-routes-{current_signature().key()}-{builds}-{kernels.source_key()}.json"


def _load_disk() -> dict[str, dict]:
    try:
        entries = json.loads(cache_path().read_text()).get("entries", {})
        return {k: v for k, v in entries.items() if isinstance(v, dict) and v.get("route") in ROUTES}
    except (OSError, ValueError, AttributeError):
        return {}


def _store_disk(key: RouteKey, name: str, timings: dict[str, float]) -> None:
    try:  # an unwritable cache only costs a new timing next time
        entries = {**_load_disk(), _disk_key(key): {"route": name, "seconds": timings}}
        atomic_write_json(cache_path(), {"signature": current_signature().to_dict(), "entries": entries})
    except OSError:
        pass


def choose_route(layer, rows: int) -> str:
    """The fastest route for this layer's key: from this process, the disk cache, or timed now (then cached)."""
    key = key_for(layer, rows)
    name = _CHOSEN.get(key)
    if name is None:
        stored = _load_disk().get(_disk_key(key))
        if stored is not None and available(stored["route"]):
            name, timings = stored["route"], stored.get("seconds", {})
        else:
            timings = time_routes(layer, key.rows)
            name = min(timings, key=timings.__getitem__)
            _store_disk(key, name, timings)
        _TIMINGS[key] = timings
        _CHOSEN[key] = name
    return name


def set_route(key: RouteKey, name: str) -> None:
    if name not in ROUTES:
        raise ValueError(f"unknown quantised route {name!r} (known: {', '.join(ROUTES)})")
    _CHOSEN[key] = name
    _GENERATION[0] += 1


def clear_routes() -> None:
    _CHOSEN.clear()
    _TIMINGS.clear()
    _GENERATION[0] += 1


def route_table() -> list[dict]:
    """Every decision so far with its timings: what a report or an accel cache stores."""
    return [{**asdict(key), "route": _CHOSEN[key], "seconds": _TIMINGS.get(key, {})} for key in _CHOSEN]


def describe(layers: Iterable, rows: tuple[int, ...] = (1, 256)) -> list[str]:
    """One line per quantised (scheme, shape) of ``layers``: its route at each of ``rows`` (a decode step's one row,
    a prefill's hundreds) and the timings that chose it. Routes this machine has not timed yet are timed now and
    cached, as a first run would, so the lines say what a run here does (``seqlab info``)."""
    shapes: dict[tuple[int, int, int, int], list] = {}
    for layer in layers:
        shapes.setdefault((layer.bits, layer.group_size, layer.in_features, layer.out_features), []).append(layer)
    lines = []
    for (bits, group, k, n), same in shapes.items():
        parts = []
        for r in rows:
            name = choose_route(same[0], r)
            timings = _TIMINGS.get(key_for(same[0], r))  # none where set_route pinned the route
            times = _durations(timings) if timings else "pinned"
            parts.append(f"{r} row{'s' if r > 1 else ''}: {name} ({times})")
        scheme = f"int{bits} " + (f"g{group}" if group else "per-channel")  # group 0: one scale per output channel
        lines.append(f"    {scheme:<16} {k:>6d} -> {n:<6d} x{len(same):<3d} " + "; ".join(parts))
    return lines


def _durations(timings: dict[str, float]) -> str:
    """``"kernel 9.7 ms, kernel512 8.5 ms, dequant 3.8 ms"``: one unit per comparison (9389 us against 10.1 ms reads
    the wrong way round), ms once the slowest reaches 10 ms."""
    if max(timings.values()) >= 0.01:
        return ", ".join(f"{route} {s * 1e3:.1f} ms" for route, s in timings.items())
    return ", ".join(f"{route} {s * 1e6:.0f} us" for route, s in timings.items())


def _addresses(buffers: dict) -> tuple[int, int, int]:
    bias = buffers.get("bias")
    return buffers["qweight"].data_ptr(), buffers["scales"].data_ptr(), 0 if bias is None else bias.data_ptr()


def run_route(layer, x: Tensor) -> Tensor:
    """``x @ W.T (+ bias)`` by the chosen route, whose prepared product the layer keeps per row count.

    An entry is checked against the addresses of the layer's buffers (``model.to(...)`` and ``deepcopy`` give
    new ones) and the decision generation (``set_route``/``clear_routes``), so a stale product never runs.
    """
    where = _addresses(layer._buffers)
    cached = layer.prepared.get(x.shape[0])
    if cached is None or cached[0] != _GENERATION[0] or cached[1] != where:
        name = choose_route(layer, x.shape[0])
        if not available(name):
            name = "dequant"
        if len(layer.prepared) > 64:  # prefill lengths vary: keep the table small
            layer.prepared.clear()
        cached = (_GENERATION[0], where, ROUTES[name](layer))
        layer.prepared[x.shape[0]] = cached
    return cached[2](x)

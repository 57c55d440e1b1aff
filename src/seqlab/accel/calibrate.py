"""Calibration: time every available route on each product shape, on this machine, and remember the result.

Why: which library or layout runs a product fastest depends on the CPU, its ISA limits, the torch build, the
shape and the number of rows; a threshold measured on one machine is wrong on the next. So the first use of a
shape class times the routes (interleaved rounds, best round per call, on throwaway layers of that shape) and caches
the timings on disk, keyed by :class:`~seqlab.runtime.cpu.CpuSignature`. A different CPU, ISA cap, thread count or
torch version is a different cache file, and a file whose stored signature disagrees is ignored.

Cache location: ``$SEQLAB_ACCEL_CACHE`` (a folder), else seqlab's cache folder (``$SEQLAB_CACHE``, else
``$XDG_CACHE_HOME/seqlab`` or ``~/.cache/seqlab``); one file ``accel-<signature hash>.json`` per signature. Delete it
to recalibrate.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import os
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from seqlab.runtime.cpu import CpuSignature, current_signature
from seqlab.accel.routes import Route, Use
from seqlab.runtime import atomic_write_json
from seqlab.runtime.files import cache_root

try:  # POSIX only; elsewhere concurrent calibrations may each keep their own choice
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

CACHE_ENV = "SEQLAB_ACCEL_CACHE"
_FORMAT = 2  # 2: the onednn-forward training route exists (a cache from before holds no timing for it)
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# a route whose first (warm-up) call is this many times slower than the plain one is dropped without further
# timing: emulated bf16 on a CPU without native bf16 would otherwise eat the whole budget
_HOPELESS = 20.0
# a route replaces the plain one only when it is at least this much (a fraction) faster
MIN_GAIN = 0.05
T = TypeVar("T")


# seconds of timing taken (not read from the cache) within the enclosing measuring_time(), if any
_MEASURING: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("seqlab_measuring_s", default=None)


@contextlib.contextmanager
def measuring_time() -> Iterator[list[float]]:
    """Within it, the seconds spent taking timings (not those read from the cache) add up in the list's one item:
    what ``accelerate`` reports as its calibration, however many of its steps measured."""
    total = [0.0]
    token = _MEASURING.set(total)
    try:
        yield total
    finally:
        _MEASURING.reset(token)


def count_measuring(seconds: float) -> None:
    """Add ``seconds`` of timing to the enclosing :func:`measuring_time` (none: nothing to do)."""
    total = _MEASURING.get()
    if total is not None:
        total[0] += seconds


def measured(measure: Callable[[], T]) -> T:
    """``measure()``, its seconds counted towards the enclosing :func:`measuring_time`."""
    t0 = time.perf_counter()
    try:
        return measure()
    finally:
        count_measuring(time.perf_counter() - t0)


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return cache_root()


def cache_path(sig: CpuSignature) -> Path:
    return cache_dir() / f"accel-{sig.key()}.json"


def shape_key(use: Use, in_features: int, out_features: int, bias: bool, extra_routes: Collection[str] = ()) -> str:
    """The shape class a measurement stands for: use, dtype, rows, product shape, bias, and the routes a caller
    added to seqlab's own (timed with them, an entry is no choice for a caller that cannot run them, nor the
    reverse)."""
    extra = f"|routes={'+'.join(sorted(extra_routes))}" if extra_routes else ""
    return f"{use.for_}|{dtype_name(use.dtype)}|rows={use.rows}|{in_features}x{out_features}|bias={int(bias)}{extra}"


_WARNED: set[str] = set()  # cache files whose malformed entries this process has reported


def _is_timing(entry: object) -> bool:
    """A cache entry as calibration writes it: route (or candidate) names to positive seconds, infinite where every
    call declined (``best_of_rounds``), none where nothing was timed (a prefill with no length to time; an entry's
    callers say which names they need)."""
    return isinstance(entry, dict) and all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0  # NaN > 0 is False
        for k, v in entry.items())


def _say_once(path: Path, what: str) -> None:
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        print(f"[seqlab] {path}: {what}; measured again", file=sys.stderr)


def load_cache(sig: CpuSignature) -> dict[str, dict[str, float]]:
    """The cached timings (shape key -> route -> seconds per call) for ``sig``; empty if absent or stale. Entries
    that are not timings (a hand edit, a negative or NaN time, an emptied entry) are left out, said once, and
    measured again: they could crash a choice or win it."""
    path = cache_path(sig)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        _say_once(path, "not a readable calibration cache")
        return {}
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("signature") != sig.to_dict():
        return {}  # measured on another CPU, under other ISA caps, or with another torch: worthless here
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        _say_once(path, "its entries are not a JSON object")
        return {}
    kept = {k: v for k, v in entries.items() if _is_timing(v)}
    if len(kept) < len(entries):
        bad = next(k for k in entries if k not in kept)
        _say_once(path, f"{len(entries) - len(kept)} of its entries are not timings (e.g. {bad!r})")
    return kept


def store_cache(sig: CpuSignature, new: dict[str, dict[str, float]],
                replace: Collection[str] = ()) -> dict[str, dict[str, float]]:
    """Merge ``new`` into the cache file and return the merged entries, which the caller must use.

    Entries already in the file win over new ones, under a lock: processes that calibrate the same shape at the
    same time (test workers, DDP ranks) all end up with one choice, so a resumed run takes the routes its first
    run took. ``replace`` names entries of ``new`` that win instead (the file's lacked what is timed now). An
    unwritable cache only costs a recalibration next time.
    """
    def merged() -> dict[str, dict[str, float]]:
        return {**new, **load_cache(sig), **{k: new[k] for k in replace if k in new}}

    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        with open(cache_path(sig).with_suffix(".lock"), "a+") as lock:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)
            entries = merged()
            atomic_write_json(cache_path(sig), {"format": _FORMAT, "signature": sig.to_dict(), "entries": entries})
        return entries
    except OSError:
        return merged()


def _probe_layer(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, seed: int) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=g) / in_features ** 0.5)
        if bias:
            layer.bias.zero_()
    return layer.to(dtype)


def _runner(module: nn.Module, use: Use, x: torch.Tensor) -> Callable[[], None]:
    if use.inference:
        def run() -> None:
            with torch.inference_mode():
                module(x)
        return run
    params = [p for p in module.parameters() if p.requires_grad]

    def step() -> None:
        with torch.autocast("cpu", dtype=use.dtype, enabled=use.dtype != torch.float32):
            y = module(x)
        y.float().sum().backward()
        for p in params:
            p.grad = None
    return step


def time_routes(use: Use, in_features: int, out_features: int, bias: bool, routes: Sequence[Route],
                budget_s: float, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Seconds per product for each available route (best of interleaved rounds, within about ``budget_s``); the
    first route is the plain one and is always timed. Routes that fail to convert or run are left out."""
    weight_dtype = use.dtype if use.inference else torch.float32  # training: fp32 master weights under autocast
    x = torch.randn(use.rows, in_features, dtype=weight_dtype, requires_grad=not use.inference)
    runners: dict[str, Callable[[], None]] = {}
    for route in routes:
        if route.name in runners or not route.available(use):
            continue
        layer = _probe_layer(in_features, out_features, bias, weight_dtype, seed=in_features * 7919 + out_features)
        if use.inference:
            layer.requires_grad_(False)
        try:
            runners[route.name] = _runner(route.convert(layer, use), use, x)
        except (RuntimeError, ValueError, NotImplementedError):
            continue
    first: dict[str, float] = {}
    for name, run in list(runners.items()):  # warm-up: kernels JIT-compiled (first call), then one timed call
        try:
            run()
            t0 = clock()
            run()
        except (RuntimeError, ValueError, NotImplementedError):
            del runners[name]
            continue
        first[name] = clock() - t0
    plain = next(iter(first.values()), 0.0)
    for name in list(runners)[1:]:
        if first[name] > _HOPELESS * plain + 1e-3:
            del runners[name]
    # the warm-up's timed call is a sample too; at least one interleaved round follows even when the warm-up spent
    # the budget (a large LM head), so no choice rests on a single call that a busy moment of the machine can spoil
    samples: dict[str, list[float]] = {name: [first[name]] for name in runners}
    reps = max(1, min(50, int(2e-3 / max(plain, 1e-7))))  # a round of the plain route takes ~2 ms or more
    round_cost = reps * sum(first[name] for name in runners)
    rounds = max(1, min(15, int((budget_s - sum(first.values())) / max(round_cost, 1e-9))))
    for _ in range(rounds):
        for name, run in runners.items():  # interleaved: a busy phase of a shared machine hits every route
            t0 = clock()
            for _ in range(reps):
                run()
            samples[name].append((clock() - t0) / reps)
    # the minimum, not the median: other processes only ever add time, so the fastest round is the kernel's speed
    return {name: min(s) for name, s in samples.items()}


def best_of_rounds(runs: Mapping[str, Callable[..., object]], rounds: int,
                   clock: Callable[[], float] = time.perf_counter, setup: Callable[[str], object] | None = None,
                   declined: Callable[[object], bool] | None = None, warm_up: bool = True) -> dict[str, float]:
    """Seconds per call of each of ``runs``: a warm-up round (kernels built, primitives made; ``warm_up=False``
    where the same calls already ran at another size), then ``rounds`` interleaved rounds, so a busy phase of the
    shared machine hits every candidate alike, and the best round of each, since other processes only ever add
    time. With ``setup``, each call gets ``setup(name)``, made outside
    the timed span (a fresh cache, say); a call whose result ``declined`` rejects (a kernel that fell back) is not
    a sample, so it cannot win by being quick."""
    best = dict.fromkeys(runs, float("inf"))
    first = 0 if warm_up else 1
    for r in range(first, rounds + 1):
        for name, run in runs.items():
            args = () if setup is None else (setup(name),)
            t0 = clock()
            result = run(*args)
            elapsed = clock() - t0
            took = declined is None or not declined(result)
            del args, result  # neither kept alive through the next call (a probe's cache and outputs are large)
            if r and took:
                best[name] = min(best[name], elapsed)
    return best


def fastest(timings: dict[str, float], plain: str = "dense") -> str:
    """The fastest route; the plain one unless another beats it by more than ``MIN_GAIN`` (timing noise must not
    swap a correct, plain product for an equally fast but different one)."""
    if plain not in timings:
        return min(timings, key=timings.__getitem__)
    best = min(timings, key=timings.__getitem__)
    return best if timings[best] < (1.0 - MIN_GAIN) * timings[plain] else plain


def cached_timings(key: str, measure: Callable[[], dict[str, float]], use_cache: bool = True,
                   required: Collection[str] = ()) -> dict[str, float]:
    """The cache entry ``key`` of this CPU signature, where an earlier process stored it with every ``required``
    timing; else ``measure()``, stored (and, where another process stored the entry meanwhile, that one: all end
    up with one choice)."""
    sig = current_signature()
    cached = load_cache(sig).get(key) if use_cache else None
    timings = dict(cached or {})
    if not timings or not set(required) <= timings.keys():
        timings = measured(measure)
        if use_cache:  # the file's entry, where it lacked what is needed, gives way to this one
            timings = dict(store_cache(sig, {key: timings}, replace=[key] if cached is not None else ())[key])
    return timings


def builds_per_dtype(dtypes: Sequence[torch.dtype], key: Callable[[torch.dtype], str],
                     candidates: Callable[[torch.dtype], Mapping[str, object]],
                     measure: Callable[[torch.dtype, Mapping[str, object]], dict[str, float]], plain: str,
                     use_cache: bool = True) -> tuple[dict[torch.dtype, str], dict[str, float]]:
    """For each compute dtype, the candidate that beats the ``plain`` route by ``MIN_GAIN`` (none: ``plain`` stays),
    from ``measure(dtype, candidates(dtype))`` (name -> seconds, ``plain`` among them) or the cache entry
    ``key(dtype)``; and every timing as ``"<dtype> <name>"``. The training kernels' choice: one build per dtype."""
    builds, all_timings = {}, {}
    for dtype in dtypes:
        named = candidates(dtype)
        timings = cached_timings(key(dtype), lambda: measure(dtype, named), use_cache, required=[plain, *named])
        best = fastest({k: v for k, v in timings.items() if k == plain or k in named}, plain=plain)
        if best in named:
            builds[dtype] = best
        all_timings |= {f"{dtype_name(dtype)} {name}": t for name, t in timings.items()}
    return builds, all_timings


def describe_builds(builds: Mapping[torch.dtype, str]) -> str:
    """``"fp32 on seqlab's kernel (avx512), bf16 on seqlab's kernel (amx)"``: what a per-dtype kernel runs on."""
    return ", ".join(f"{dtype_name(dt)} on seqlab's kernel ({isa})" for dt, isa in builds.items())


def timings_by_size(key: str, sizes: Sequence[int], time_at: Callable[[int], dict[str, float]],
                    use_cache: bool = True, names: Sequence[str] = ()) -> dict[str, float]:
    """``{"<candidate>@<size>": seconds}`` for every size, from ``time_at(size)`` (candidate -> seconds) or from the
    cache entry ``key`` of this CPU signature, where an earlier process stored it with every one of ``names``."""
    return cached_timings(key, lambda: {f"{name}@{n}": s for n in sizes for name, s in time_at(n).items()},
                          use_cache, required=[f"{name}@{n}" for name in names for n in sizes])


def winning_from(timings: dict[str, float], builds: Sequence[str], sizes: Sequence[int], plain: str,
                 min_speedup: float) -> tuple[str, int | None]:
    """The build fastest at the largest size, and the smallest size from which it beats ``plain`` by
    ``min_speedup`` at that and every larger size (None: not even at the largest)."""
    build = min(builds, key=lambda b: timings[f"{b}@{sizes[-1]}"])
    smallest = None
    for n in reversed(sizes):
        if timings[f"{build}@{n}"] * min_speedup > timings[f"{plain}@{n}"]:
            break
        smallest = n
    return build, smallest

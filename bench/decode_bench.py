"""Decode benchmark: seqlab vs Hugging Face ``generate`` on the same weights, and the weight-streaming bound.

Used by ``bench/generate_decode.py`` and ``bench/real_models_smollm2.py``; it lives outside the package because it
imports ``transformers``, a development-only dependency. Everything is measured in one process, interleaved
(HF, seqlab, HF, seqlab, ...) and summarised by the median, because the machine is shared and only ratios taken
in the same run mean anything.

* decode tok/s: ``new / (t(1 + new tokens) - t(1 token))`` for both libraries, i.e. the prefill and the first
  token are subtracted out the same way, so per-step overhead is all that differs.
* TTFT: a 512-token prompt, ``max_new_tokens=1``.
* allocator: the process keeps freed blocks (``runtime.memory.keep_freed_blocks``), as ``seqlab generate`` and
  ``chat`` do. Without it a prefill's page faults depended on the heap's history: 200 to 24 000 a prefill (6-layer
  model) from one process to the next, up to 20 % of the time, for HF as for seqlab. HF shares the process, so it
  runs with the same allocator.
* columns: ``seqlab`` (the model as built: dense ``nn.Linear`` weights), ``seqlab+accel`` (a copy after
  :func:`seqlab.accel.accelerate` for ``rows``-row decode in the same dtype, what ``seqlab generate``/``chat``
  run with ``--dtype fp32|bf16``), ``seqlab default`` (fp32 rows: the copy ``--dtype auto``, the CLI default,
  runs: bf16 products where native and measured faster), ``seqlab+accel+compile`` (optional: that copy's decode step under ``torch.compile``), ``hf``.
* weight bound: every weight matrix of the model applied to ``batch`` activation rows, back to back, in the
  model's dtype, with the faster of two kernels (``F.linear`` on dense weights, oneDNN on packed ones, whatever
  the accelerated copy chose): the time
  a decode step would take if it did nothing but stream the weights once. ``bound / step`` is the fraction of
  each step that is weight streaming (1.0 = no overhead at all). It is a yardstick, not a hard floor: a fused
  step that keeps a layer's weights in cache across products, or a copy whose dtype differs from the bound's
  (``seqlab default`` at batch > 1 takes bf16 weights where ``auto`` chose them; its bound stays the fp32
  products'), can read above 100 %.
* TTFT's arithmetic bound (fp32 rows): the FLOPs no prefill of the prompt can skip (:func:`prefill_flops`) at the
  rate of a 2048-square fp32 product timed in each round. A long prefill is compute-bound, so this is its floor as
  the weight bound is a decode step's; ``HF / bound`` is the best ratio to HF any fp32 prefill could reach in that
  run (above 1 in ``bound / TTFT``: a bf16 route beat fp32's floor).
"""
from __future__ import annotations

import copy
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from bench_common import check_count_list, check_positive
from seqlab.accel import PackedLinear, accelerate
from seqlab.config import ModelConfig
from seqlab.generate import GenerationConfig, generate_output
from seqlab.io.checkpoint import load_state_into
from seqlab.io.hf import convert_hf_state_dict
from seqlab.model import build_model
from seqlab.runtime.memory import keep_freed_blocks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_options(ap, args, positive: tuple[str, ...]) -> None:
    """Bad bench options refused at the start, by name (not as a KeyError or ZeroDivisionError minutes in): every
    dtype known, the ``positive`` counts above zero, ``--clock cpu`` only with one thread (process CPU time sums the
    threads, so a multi-threaded step would read as slower by their number)."""
    unknown = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown:
        ap.error(f"--dtypes: unknown {', '.join(unknown)} (choose from {', '.join(DTYPES)})")
    check_positive(ap, args, positive)
    if getattr(args, "batches", None) is not None:
        check_count_list(ap, "--batches", args.batches)
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu counts the CPU time of every thread: give --threads 1 with it")


@dataclass
class BenchConfig:
    vocab_size: int = 32000
    d_model: int = 512
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int = 8
    d_ff: int = 1408  # the Llama rule for d=512: 2/3 * 4d rounded up to a multiple of 64
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    batches: tuple[int, ...] = (1, 8)
    decode_prompt_len: int = 32
    new_tokens: int = 64
    ttft_prompt_len: int = 512
    repeats: int = 3
    compare_hf: bool = True
    compile: bool = False
    seed: int = 0
    threads: int | None = None
    clock: str = "wall"  # "wall" (perf_counter) or "cpu" (process CPU time: robust to other jobs on a shared box)


@dataclass
class BenchRow:
    dtype: str
    batch: int
    impl: str
    decode_tok_s: float
    ms_per_step: float
    bound_ms: float = 0.0
    frac_of_bound: float = 0.0  # bound / step time: 1.0 = nothing but weight streaming
    samples: list[float] = field(default_factory=list)


def build_models(bc: BenchConfig, dtype: torch.dtype, with_hf: bool):
    """A random Llama-style model as HF ``LlamaForCausalLM`` and the same weights imported into seqlab."""
    torch.manual_seed(bc.seed)
    if with_hf:
        # imported here, not at the top: importing transformers adds about 145 MiB of RSS to every process that
        # imports this module (quant_speed's peak-RSS workers of the seqlab columns among them)
        from transformers import LlamaConfig, LlamaForCausalLM

        hcfg = LlamaConfig(vocab_size=bc.vocab_size, hidden_size=bc.d_model, intermediate_size=bc.d_ff,
                           num_hidden_layers=bc.n_layers, num_attention_heads=bc.n_heads,
                           num_key_value_heads=bc.n_kv_heads, max_position_embeddings=4096, rms_norm_eps=1e-5,
                           tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        hf = LlamaForCausalLM(hcfg).eval()
        cfg, state = convert_hf_state_dict(hf.config.to_dict(), hf.state_dict())
        model = build_model(cfg)
        load_state_into(model, state, "bench")
        return model.to(dtype).eval(), hf.to(dtype).eval()
    cfg = ModelConfig(vocab_size=bc.vocab_size, d_model=bc.d_model, n_layers=bc.n_layers, n_heads=bc.n_heads,
                      n_kv_heads=bc.n_kv_heads, d_ff=bc.d_ff, max_seq_len=4096, tie_embeddings=False)
    return build_model(cfg).to(dtype).eval(), None


def weight_matrices(model) -> list[torch.Tensor]:
    """Every weight a decode step multiplies by (linear layers incl. the LM head; not the embedding lookup)."""
    return [m.weight.detach() for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]


@torch.inference_mode()
def weight_bound_ms(model, batch: int, repeats: int = 10, clock=None, packed=None) -> dict[str, float]:
    """Time to apply every weight matrix once to ``batch`` rows, per kernel, median of ``repeats``.

    ``dense``: ``F.linear`` on ``model``'s ``[out, in]`` weights (what an unpacked model, and HF, run); ``packed``:
    oneDNN on the packed weights of ``packed`` (an accelerated copy -- the very tensors its decode step streams),
    where it packed any. ``bound`` is the faster of the two: what a decode step that only streamed its weights
    through these products would take on this machine, whichever kernel a library picks (a fused step that keeps
    weights in cache between products can beat it: see the module docstring).
    """
    clock = clock or CLOCK
    weights = weight_matrices(model)
    dtype = weights[0].dtype
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=dtype) for w in weights}
    kernels = {"dense": [lambda w=w: F.linear(xs[w.shape[1]], w) for w in weights]}
    if packed is not None and any(isinstance(m, PackedLinear) for m in packed.modules()):
        kernels["accel"] = [  # each layer as the accelerated copy runs it: packed where calibration packed it
            (lambda m=m: torch.ops.mkldnn._linear_pointwise(xs[m.in_features], m.packed, None, "none", [], ""))
            if isinstance(m, PackedLinear) else (lambda m=m: F.linear(xs[m.in_features], m.weight))
            for m in packed.modules() if isinstance(m, (PackedLinear, torch.nn.Linear))]
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for i in range(repeats + 1):
        for name, calls in kernels.items():  # interleaved, so a slow phase of a shared machine hits both
            t0 = clock()
            for call in calls:
                call()
            if i:  # the first pass is a warm-up
                times[name].append(clock() - t0)
    out = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    out["bound"] = min(out.values())
    return out


def matmul_peak(dtype: torch.dtype, n: int = 1024, reps: int = 10, clock=time.perf_counter) -> float:
    """The fastest square product this machine has in ``dtype`` (FLOP/s): MKL's (``a @ b``) or, in fp32, oneDNN's
    (what the accel routes run). On an AMD EPYC MKL's fp32 product runs at half oneDNN's rate, and an MFU over MKL's
    alone passed 100 %. ``clock``: the one the times it is compared with were taken on."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    kernels = [lambda: a @ b]
    onednn = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if onednn is not None and dtype == torch.float32 and torch.backends.mkldnn.is_available():
        kernels.append(lambda: onednn(a, b, None, "none", [], ""))  # a @ b.T: the same FLOPs
    best = float("inf")
    for kernel in kernels:
        for _ in range(2):
            kernel()
        for _ in range(3):
            t = clock()
            for _ in range(reps):
                kernel()
            best = min(best, (clock() - t) / reps)
    return 2 * n**3 / best


def prefill_flops(cfg: ModelConfig, prompt_len: int) -> float:
    """The arithmetic no prefill of ``prompt_len`` tokens can skip, for a decoder with ``cfg``'s shapes.

    Every layer's products on every position, but the last layer's queries, output and MLP on the last position
    only (its keys and values still go into the cache); the causal half of each attention product
    (``T(T+1)/2`` query-key pairs); the LM head on one row. A floor: HF computes more (every position's MLP and
    head in the last layer), and seqlab too, a little (its fused QKV product forms the last layer's queries on every
    position; ``tests/test_bench_bounds.py`` counts both).
    """
    T, d, hd = prompt_len, cfg.d_model, cfg.head_dim
    q, kv = cfg.n_heads * hd, 2 * cfg.n_kv_heads * hd
    mlp = (3 if cfg.mlp == "swiglu" else 2) * d * cfg.d_ff
    query_side = d * q + q * d + mlp  # per row: the query product, the output product, the MLP
    pairs = T * (T + 1) // 2
    layer = T * (d * kv + query_side) + 2 * cfg.n_heads * hd * pairs
    last = T * d * kv + query_side + 2 * cfg.n_heads * hd * T
    return 2.0 * ((cfg.n_layers - 1) * layer + last + d * cfg.vocab_size)


def prefill_bound_ms(cfg: ModelConfig, prompt_len: int, clock=time.perf_counter) -> float:
    """An fp32 prefill's floor on this machine now: :func:`prefill_flops` at the 2048-square product's rate.

    Why: a long prompt's prefill is compute-bound, so, as the weight-streaming bound does for a decode step, this
    says how much of a TTFT any implementation could still take off, and the best ratio to HF any fp32 prefill
    could reach in the same run (HF's TTFT over the bound). Taken once per round, interleaved with the TTFTs, so a
    slow phase of the machine moves both. ``clock``: the TTFTs' own (wall, or process CPU time).
    """
    return prefill_flops(cfg, prompt_len) / matmul_peak(torch.float32, 2048, reps=2, clock=clock) * 1e3


CLOCK = time.perf_counter


def _time(fn) -> float:
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


def run_benchmark(bc: BenchConfig, log=print) -> dict:
    global CLOCK
    CLOCK = time.process_time if bc.clock == "cpu" else time.perf_counter
    if bc.threads:
        torch.set_num_threads(bc.threads)
    keep_freed_blocks()  # as `seqlab generate`/`chat` run (see the module docstring)
    results: dict = {"config": asdict(bc), "torch": torch.__version__, "threads": torch.get_num_threads(),
                     "clock": bc.clock, "load_avg_before": os.getloadavg(), "allocator": "keep_freed_blocks",
                     "rows": [], "ttft": []}
    for dname in bc.dtypes:
        dtype = DTYPES[dname]
        model, hf = build_models(bc, dtype, bc.compare_hf)
        g = torch.Generator().manual_seed(bc.seed)
        for batch in bc.batches:
            ids = torch.randint(0, bc.vocab_size, (batch, bc.decode_prompt_len), generator=g)
            n = bc.new_tokens
            packed = packed_copy(model, batch)
            default = default_copy(model, batch, dname)

            def ours(k, m=model, compiled=False):
                cfg = GenerationConfig(max_new_tokens=k, eos_token_id=[], compile=compiled)
                return lambda: generate_output(m, ids, None, cfg).sequences

            def theirs(k):
                return lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k,
                                           min_new_tokens=k, do_sample=False, pad_token_id=0)

            impls = {"seqlab": ours}
            if packed is not None:
                impls["seqlab+accel"] = lambda k: ours(k, packed)
            if default is not None:
                impls["seqlab default"] = lambda k: ours(k, default)
            if bc.compile:  # compile what runs fastest eagerly: the packed model where there is one
                impls["seqlab+accel+compile" if packed is not None else "seqlab+compile"] = \
                    lambda k: ours(k, packed if packed is not None else model, compiled=True)
            if hf is not None:
                impls["hf"] = theirs
            outs = {}
            for name, fn in impls.items():  # warm-up (and compilation); keep the tokens to compare
                t0 = time.perf_counter()
                outs[name] = fn(n + 1)()
                fn(1)()
                log(f"{dname:5s} batch {batch:2d} {name}: warm-up {time.perf_counter() - t0:.1f} s")
            for name, seq in outs.items():
                same = (seq == outs["seqlab"]).all(dim=1).float().mean().item()
                results.setdefault("agreement", []).append(
                    {"dtype": dname, "batch": batch, "impl": name, "rows_identical_to_seqlab_eager": same})
                if name != "seqlab":
                    log(f"{dname:5s} batch {batch:2d} {name}: {same:.0%} of rows token-identical to seqlab eager")
            samples: dict[str, list[float]] = {k: [] for k in impls}
            bounds: list[dict[str, float]] = []
            for _ in range(bc.repeats):  # interleaved, so slow phases of the shared machine hit every column
                for name, fn in impls.items():
                    t_full, t_one = _time(fn(n + 1)), _time(fn(1))
                    samples[name].append((t_full - t_one) / n)  # seconds per decode step
                bounds.append(weight_bound_ms(model, batch, packed=packed))
            bound = statistics.median(b["bound"] for b in bounds)
            results.setdefault("bound_samples_ms", []).append({"dtype": dname, "batch": batch, "samples": bounds})
            log(f"{dname:5s} batch {batch:2d} weight bound: " + ", ".join(
                f"{k} {statistics.median(b[k] for b in bounds):.2f} ms" for k in bounds[0]))
            for name, s in samples.items():  # noqa: B007
                step = statistics.median(s)
                row = BenchRow(dname, batch, name, batch / step, step * 1e3, bound, bound / (step * 1e3),
                               [x * 1e3 for x in s])
                results["rows"].append(asdict(row))
                log(f"{dname:5s} batch {batch:2d} {name:14s}: {row.decode_tok_s:8.1f} tok/s  "
                    f"{row.ms_per_step:6.2f} ms/step  bound {bound:5.2f} ms  ({row.frac_of_bound:.0%} of bound)")
            del packed, default
        # TTFT for a long prompt, batch 1
        ids = torch.randint(0, bc.vocab_size, (1, bc.ttft_prompt_len), generator=g)
        packed, default = packed_copy(model, 1), default_copy(model, 1, dname)
        one = GenerationConfig(max_new_tokens=1, eos_token_id=[])
        runs = {"seqlab": lambda: generate_output(model, ids, None, one)}
        if packed is not None:
            runs["seqlab+accel"] = lambda: generate_output(packed, ids, None, one)
        if default is not None:
            runs["seqlab default"] = lambda: generate_output(default, ids, None, one)
        if hf is not None:
            runs["hf"] = lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                                             do_sample=False, pad_token_id=0)
        ttft: dict[str, list[float]] = {k: [] for k in runs}
        for fn in runs.values():
            fn()  # warm-up
        bounds = []
        for _ in range(bc.repeats):
            for name, fn in runs.items():
                ttft[name].append(_time(fn))
            if dname == "fp32":
                bounds.append(prefill_bound_ms(model.config, bc.ttft_prompt_len, clock=CLOCK))
        bound = statistics.median(bounds) if bounds else None
        if bound is not None:
            log(f"{dname:5s} TTFT {bc.ttft_prompt_len}-token prompt fp32 arithmetic bound: {bound:7.1f} ms")
        copies = {"seqlab+accel": packed, "seqlab default": default}
        for name, s in ttft.items():
            route = prefill_route(copies.get(name), bc.ttft_prompt_len)
            ms = statistics.median(s) * 1e3
            results["ttft"].append({"dtype": dname, "impl": name, "prompt_len": bc.ttft_prompt_len, "ttft_ms": ms,
                                    "samples_ms": [x * 1e3 for x in s], **bound_fields(bound, ms),
                                    **({"prefill_route": route} if route else {})})
            log(f"{dname:5s} TTFT {bc.ttft_prompt_len}-token prompt {name:14s}: {ms:7.1f} ms"
                + (f"  ({bound / ms:.0%} of the bound)" if bound else "") + (f"  (prefill: {route})" if route else ""))
        del model, hf, packed, default
    return results


def bound_fields(bound_ms: float | None, ttft_ms: float) -> dict:
    """A TTFT row's arithmetic bound and the fraction of it reached (above 1 where a bf16 route beats fp32's floor)."""
    return {} if bound_ms is None else {"bound_ms": bound_ms, "frac_of_bound": bound_ms / ttft_ms}


def packed_copy(model, rows: int, for_: str = "decode", dtype=None):
    """An accelerated copy of ``model`` for ``rows``-row products, in the model's dtype (``dtype=None``) or as the
    CLI's default runs it (``"auto"``); routes chosen by :func:`seqlab.accel.accelerate`'s calibration, cached."""
    return accelerate(copy.deepcopy(model), for_, rows=rows, dtype=dtype)


def prefill_route(model, n_tokens: int) -> str | None:
    """The route an accelerated copy's prefill of ``n_tokens`` tokens took, and the calibration's whole chain
    (``"bf16 (plan: 64+ tokens in fp32 on oneDNN, 256+ in bf16)"``, or ``"plain products"``), for the TTFT rows: the
    choice is timed per process, so a results file must say which one ran."""
    plan = getattr(model, "accel_plan", None)
    cast = getattr(model, "prefill_cast", None)
    if plan is None:
        return None
    if not plan.prefill_from or cast is None:
        return "plain products"
    return f"{cast.route_for(n_tokens)} (plan: {plan.prefill_route})"


def default_copy(model, rows: int, dname: str):
    """What ``seqlab generate``/``chat`` run by default (``--dtype auto``) for an fp32 model; None for bf16 rows."""
    return packed_copy(model, rows, dtype="auto") if dname == "fp32" else None


def ratio_table(results: dict) -> str:
    """Markdown table: per dtype and batch, both implementations, the speed-up and the fraction of the bound."""
    rows = {(r["dtype"], r["batch"], r["impl"]): r for r in results["rows"]}
    lines = ["| dtype | batch | impl | tok/s | ms/step | vs HF | weight bound ms/step | bound / step |",
             "|---|---|---|---|---|---|---|---|"]
    for (dt, b, impl), r in rows.items():
        h = rows.get((dt, b, "hf"))
        ratio = f"{r['decode_tok_s'] / h['decode_tok_s']:.2f}x" if h else "-"
        lines.append(f"| {dt} | {b} | {impl} | {r['decode_tok_s']:.1f} | {r['ms_per_step']:.2f} | {ratio} | "
                     f"{r['bound_ms']:.2f} | {r['frac_of_bound']:.0%} |")
    lines.append("")
    lines.append(ttft_table({(x["dtype"], x["impl"]): x for x in results["ttft"]}, "ttft_ms"))
    return "\n".join(lines)


def ttft_table(rows: dict, key: str, extra: dict | None = None) -> str:
    """Markdown table of TTFT rows keyed ``(dtype, impl)``: ms, vs HF, the fp32 arithmetic bound, the fraction of it
    reached, and the best ratio to HF any prefill at the bound could reach; ``extra`` adds one column
    (``{"header": ..., "cells": {(dtype, impl): text}}``)."""
    head = "| dtype | impl | TTFT ms | vs HF | fp32 bound ms | bound / TTFT | HF / bound |"
    lines = [head + (f" {extra['header']} |" if extra else ""), "|---" * (7 + bool(extra)) + "|"]
    for (dt, impl), r in rows.items():
        ms, hf = r[key], rows.get((dt, "hf"), {}).get(key)
        bound = r.get("bound_ms")
        cells = [dt, impl, f"{ms:.1f}", f"{hf / ms:.2f}x" if hf else "-", f"{bound:.1f}" if bound else "-",
                 f"{r['frac_of_bound']:.0%}" if bound else "-", f"{hf / bound:.2f}x" if bound and hf else "-"]
        if extra:
            cells.append(extra["cells"].get((dt, impl), "-"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

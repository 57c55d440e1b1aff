"""Training throughput: seqlab vs Hugging Face GPT2LMHeadModel, same config, batch and precision, one run.

Both models are GPT-2 shaped (learned positions, LayerNorm, GELU-tanh MLP, biases, tied embeddings) with
identical sizes, fed the same random token batches, and trained with the same AdamW (foreach) and gradient
clipping. One "step" = forward + loss + backward + clip + optimizer step, exactly what each library's training
loop does: seqlab through its CLM objective (``seqlab.train``'s path), HF through ``model(input_ids,
labels=input_ids).loss``. Each library runs in its own process (``Worker``: nothing carries over between them),
and the timings alternate between them (A B A B ...) so background load on a shared machine hits all alike; the
median per library is reported.

MFU = achieved model FLOP/s / measured peak matmul FLOP/s of this machine in the same precision (the 1024 square's
rate, best of the run's start and end; a line after the table gives the rates of larger squares and the MFU against
the largest, which on AMX runs well above the 1024 square). Model FLOPs per
token = 6 * (matmul parameters incl. the LM head) + 12 * n_layers * seq_len * d_model (attention scores and
values, forward + backward), the PaLM accounting.

Columns: ``seqlab`` (the plain model, AdamW foreach, as before), ``seqlab+fused`` (the same with
``AdamW(fused=True)``, what ``seqlab train`` uses), ``seqlab+accel`` (also ``seqlab.accel.accelerate(model,
"train")``: the fp32 product routes calibrated on this machine, the fused GELU and the causal attention's
forward + backward where they time faster, and ``runtime.memory.keep_freed_blocks()``: what ``seqlab train`` runs
on CPU), ``hf`` (as a user runs it: glibc's default allocator settings).

    python bench/train_throughput.py                     # fp32 and bf16, default size, native and AVX2 caps
    python bench/train_throughput.py --isa native        # this CPU's own ISA only
    python bench/train_throughput.py --compile           # also seqlab+accel with torch.compile
    python bench/train_throughput.py --gpt2-small --steps 2 --reps 3   # GPT-2 small's sizes (slow: ~2 s a step)
Writes bench/results/train_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import check_positive  # noqa: E402
from decode_bench import matmul_peak  # noqa: E402
from isa_matrix import add_isa_options, run_per_isa, strip_isa_args  # noqa: E402

from seqlab.accel import accelerate  # noqa: E402
from seqlab.runtime.cpu import compile_keyed_by_isa, native_bf16  # noqa: E402
from seqlab.runtime.memory import keep_freed_blocks  # noqa: E402


PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


SQUARE_SIZES = (1024, 2048, 4096)


def square_rates(dtype: torch.dtype) -> dict[int, float]:
    """FLOP/s of square products of each of ``SQUARE_SIZES`` (about 4 GFLOP timed per round). Why: the MFU column
    divides by the 1024 square's rate, and on AMX larger squares run well above it (the tile kernels' packing is
    paid per product), so the table says what the MFU reads against the largest too."""
    return {n: matmul_peak(dtype, n, reps=max(1, int(4e9 // (2 * n**3)))) for n in SQUARE_SIZES}


def measured_peaks(precisions: list[str], earlier: dict[str, float] | None = None) -> dict[str, float]:
    """Each precision's matmul peak, the best of this measurement and ``earlier`` (one taken at the start of the
    run). Why twice: on a shared VM one measurement can land in a slow moment (an AVX2 EPYC read 72.7 GFLOP/s at the
    start of a run whose own weight products then ran at 108, an MFU of 131 %; minutes later 128-131)."""
    return {p: max(matmul_peak(PRECISION_DTYPES[p]), (earlier or {}).get(p, 0.0)) for p in precisions}


def build_pair(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    from seqlab import ModelConfig, build_model

    cfg = ModelConfig(arch="decoder", vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers,
                      n_heads=args.n_heads, max_seq_len=args.seq_len, pos="learned", norm="layernorm", mlp="gelu",
                      activation="gelu_tanh", bias=True, tie_embeddings=True, norm_eps=1e-5)
    torch.manual_seed(0)
    ours = build_model(cfg)
    hcfg = GPT2Config(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.d_model, n_layer=args.n_layers,
                      n_head=args.n_heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True)
    try:
        hf = GPT2LMHeadModel(hcfg, attn_implementation="sdpa")
    except TypeError:
        hcfg._attn_implementation = "sdpa"
        hf = GPT2LMHeadModel(hcfg)
    n_ours = sum(p.numel() for p in {id(p): p for p in ours.parameters()}.values())
    n_hf = sum(p.numel() for p in {id(p): p for p in hf.parameters()}.values())
    assert n_ours == n_hf, f"parameter counts differ: seqlab {n_ours} vs HF {n_hf}"
    return ours, hf, n_ours


def gemm_table(args, dtype: torch.dtype, reps: int = 5) -> list[dict]:
    """Milliseconds of each weight product of one training step, per library, at the step's shapes.

    Rows: every distinct linear shape (``count`` layers have it); products: forward ``x W^T``, input gradient
    ``g W`` and weight gradient ``g^T x``, each timed with MKL (``torch.mm``, what ``F.linear`` and HF run) and with
    oneDNN (``mkldnn._linear_pointwise``, what ``seqlab.accel``'s ``onednn-train`` routes run; for the weight
    gradient in both orientations, ``g^T x`` and ``(x^T g)^T``). Repetitions interleave the kernels.
    """
    n, d, v = args.batch_size * args.seq_len, args.d_model, args.vocab
    shapes = {(d, 3 * d): args.n_layers, (d, d): args.n_layers, (d, 4 * d): args.n_layers, (4 * d, d): args.n_layers,
              (d, v): 1}
    onednn = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if dtype == torch.float32 else None

    def dnn(a, b):
        return onednn(a, b, None, "none", [], "")

    rows = []
    for (i, o), count in shapes.items():
        x, w, g = torch.randn(n, i, dtype=dtype), torch.randn(o, i, dtype=dtype), torch.randn(n, o, dtype=dtype)
        kernels = {("forward", "mkl"): lambda: x @ w.t(), ("input_grad", "mkl"): lambda: g @ w,
                   ("weight_grad", "mkl"): lambda: g.t() @ x}
        if onednn is not None:
            kernels |= {("forward", "onednn"): lambda: dnn(x, w), ("input_grad", "onednn"): lambda: dnn(g, w.t()),
                        ("weight_grad", "onednn"): lambda: dnn(g.t(), x.t()),
                        ("weight_grad", "onednn_t"): lambda: dnn(x.t(), g.t()).t().contiguous()}
        times = {k: [] for k in kernels}
        for r in range(reps + 1):
            for k, fn in kernels.items():
                t = time.perf_counter()
                fn()
                if r:
                    times[k].append(time.perf_counter() - t)
        row = {"in": i, "out": o, "rows": n, "count": count}
        row |= {f"{prod}/{lib}_ms": statistics.median(ts) * 1e3 for (prod, lib), ts in times.items()}
        rows.append(row)
    return rows


def weight_gemm_floor_s(table: list[dict]) -> float:
    """Seconds for the weight GEMMs of one training step alone, each product on the faster library for its shape.

    No implementation in the same precision and with these kernels can run a step faster than this (attention,
    softmax, norms and the optimiser only add to it), so ``HF step / floor`` is the largest speed-up over HF that
    is possible at all.
    """
    total = 0.0
    for row in table:
        for prod in ("forward", "input_grad", "weight_grad"):
            total += row["count"] * min(v for k, v in row.items() if k.startswith(prod + "/"))
    return total / 1e3


def print_gemm_table(table: list[dict]) -> None:
    cols = [k for k in table[0] if k.endswith("_ms")]
    print(f"{'in':>6}{'out':>7}{'x':>3}" + "".join(f"{c[:-3]:>22}" for c in cols))
    for row in table:
        print(f"{row['in']:>6}{row['out']:>7}{row['count']:>3}" + "".join(f"{row[c]:>22.1f}" for c in cols))


def model_flops_per_token(args) -> float:
    d, L, V, T = args.d_model, args.n_layers, args.vocab, args.seq_len
    matmul_params = L * (4 * d * d + 2 * d * 4 * d) + V * d  # qkv+out, mlp up+down, lm head
    return 6 * matmul_params + 12 * L * T * d


def make_step(lib: str, model, precision: str, vocab: int, compiled: bool = False, fused: bool = False):
    from seqlab.data import ByteTokenizer
    from seqlab.objectives import build_objective

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                            **({"fused": True} if fused else {"foreach": True}))
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else None
    fwd = compile_keyed_by_isa(model) if compiled else model  # natively and under caps: a graph cache each
    if lib == "seqlab":
        obj = build_objective("clm", ByteTokenizer())
        obj._byte_table = torch.ones(vocab, dtype=torch.long)  # the objective counts target bytes, as in training

        def loss_of(ids):
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
            out = obj.loss(fwd, batch)
            return out.loss_sum / out.n_targets
    else:
        def loss_of(ids):
            return fwd(input_ids=ids, labels=ids).loss

    def step(ids):
        if autocast is not None:
            with autocast():
                loss = loss_of(ids)
        else:
            loss = loss_of(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def _worker_main(conn, name: str, precision: str, args) -> None:
    """One library in its own process, as a user runs it: build, warm up, then time ``n`` steps per request."""
    if args.threads:
        torch.set_num_threads(args.threads)
    ours, hf, _ = build_pair(args)
    model, plan = (hf if name == "hf" else ours), None
    if "accel" in name:  # what `seqlab train` does on a CPU: the product routes, and the allocator setting
        accelerate(model, "train", rows=args.batch_size * args.seq_len, dtype=None, seq_len=args.seq_len)
        keep_freed_blocks()
        plan = model.accel_plan.summary()
    step = make_step("hf" if name == "hf" else "seqlab", model, precision, args.vocab,
                     compiled=name.endswith("compile"), fused=name != "seqlab" and name != "hf")
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=g) for _ in range(4)]
    for b in batches[:2]:  # warm up (oneDNN primitive creation, compile, the allocator's heap)
        step(b)
    conn.send(plan)
    while (n := conn.recv()) is not None:
        t = time.perf_counter()
        for i in range(n):
            step(batches[i % len(batches)])
        conn.send((time.perf_counter() - t) / n)


class Worker:
    """A library's training step in a separate process (spawned: a fresh interpreter, its own heap).

    Why separate processes: an allocator setting, a heap grown by another library's step, or oneDNN's caches would
    otherwise carry over between the libraries of one process (measured: seqlab's fp32 step under the AVX2 caps ran
    392 ms beside HF in one process, 417 ms alone). The parent still interleaves the timings (A B A B ...), so a
    drift in the machine's speed hits every library alike.
    """

    def __init__(self, name: str, precision: str, args) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, name, precision, args), daemon=True)
        self.proc.start()
        child.close()  # the worker holds the other end: if it dies, recv() raises EOFError instead of waiting
        self.plan = self.conn.recv()

    def time_steps(self, n: int) -> float:
        self.conn.send(n)
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.terminate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per repetition")
    ap.add_argument("--reps", type=int, default=5, help="alternating repetitions per library")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--compile", action="store_true", help="also time seqlab under torch.compile")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--gemm-table", action="store_true", help="print each weight product's time per library")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "train_throughput.json"))
    ap.add_argument("--gpt2-small", action="store_true",
                    help="GPT-2 small's own sizes (d 768, 12 layers, 12 heads, vocab 50257) instead of the d-256 toy")
    add_isa_options(ap)
    args = ap.parse_args()
    check_positive(ap, args, ("d_model", "n_layers", "n_heads", "vocab", "seq_len", "batch_size", "steps", "reps",
                              "threads"))
    unknown = [p for p in args.precisions.split(",") if p not in PRECISION_DTYPES]
    if unknown:
        ap.error(f"--precisions: unknown {', '.join(unknown)} (choose from {', '.join(PRECISION_DTYPES)})")
    if args.gpt2_small:
        args.d_model, args.n_layers, args.n_heads, args.vocab = 768, 12, 12, 50257
    if args.isa_child is None:  # the parent: one child per ISA
        run_per_isa(__file__, strip_isa_args(sys.argv[1:]), args.isa, args.out)
        return
    if args.threads:
        torch.set_num_threads(args.threads)

    flops_tok = model_flops_per_token(args)
    tokens = args.batch_size * args.seq_len
    precisions = args.precisions.split(",")
    if "bf16" in precisions and not native_bf16():  # emulated bf16 products: about 1 GFLOP/s, minutes a step
        print("bf16 is not native on this CPU (or under these ISA caps): timing fp32 only", flush=True)
        precisions = [p for p in precisions if p != "bf16"]
        if not precisions:
            sys.exit("no precision left to time")
    peaks = measured_peaks(precisions)
    results, plans = [], {}
    n_params = build_pair(args)[2]
    for precision in precisions:
        libs = ["seqlab", "seqlab+fused", "seqlab+accel", "hf"] + (["seqlab+accel+compile"] if args.compile else [])
        workers: dict[str, Worker] = {}
        try:
            for name in libs:
                workers[name] = Worker(name, precision, args)
            plans[precision] = workers["seqlab+accel"].plan
            times: dict[str, list[float]] = {k: [] for k in libs}
            for r in range(args.reps):
                for name in (libs if r % 2 == 0 else libs[::-1]):  # one library at a time: the others wait idle
                    times[name].append(workers[name].time_steps(args.steps))
        finally:
            for w in workers.values():
                w.close()
        for name, ts in times.items():
            sec = statistics.median(ts)
            tok_s = tokens / sec
            results.append({"library": name, "precision": precision, "step_s": sec, "tokens_per_s": tok_s,
                            "model_tflops": flops_tok * tok_s / 1e12, "step_s_all": ts, "params": n_params})
    peaks = measured_peaks(precisions, earlier=peaks)
    for r in results:
        r["mfu"] = r["model_tflops"] * 1e12 / peaks[r["precision"]]
    squares = {p: square_rates(PRECISION_DTYPES[p]) for p in precisions}
    for r in results:
        r["mfu_vs_largest_square"] = r["model_tflops"] * 1e12 / max(squares[r["precision"]].values())
    tables = {p: gemm_table(args, PRECISION_DTYPES[p]) for p in precisions}
    floors = {p: weight_gemm_floor_s(t) for p, t in tables.items()}
    speedups = {}
    for precision in precisions:
        by = {r["library"]: r for r in results if r["precision"] == precision}
        speedups[precision] = {k: by[k]["tokens_per_s"] / by["hf"]["tokens_per_s"] for k in by if k != "hf"}

    print(f"\ntraining throughput, GPT-2 shape d={args.d_model} L={args.n_layers} H={args.n_heads} V={args.vocab} "
          f"T={args.seq_len} B={args.batch_size}, {torch.get_num_threads()} threads")
    print("measured matmul peak (best of the run's start and end): "
          + ", ".join(f"{p} {v / 1e9:.1f} GFLOP/s" for p, v in peaks.items()))
    print(f"{'library':<16}{'precision':<10}{'tokens/s':>10}{'step ms':>10}{'GFLOP/s':>10}{'MFU':>8}{'vs HF':>8}")
    for r in results:
        sp = speedups[r["precision"]].get(r["library"], 1.0)
        print(f"{r['library']:<16}{r['precision']:<10}{r['tokens_per_s']:>10,.0f}{r['step_s'] * 1e3:>10.1f}"
              f"{r['model_tflops'] * 1e3:>10.1f}{r['mfu']:>8.1%}{sp:>7.2f}x")
    for precision, rates in squares.items():
        accel = next(r for r in results if r["precision"] == precision and r["library"] == "seqlab+accel")
        print(f"{precision} square products: " + ", ".join(f"{n}: {v / 1e9:.0f}" for n, v in rates.items())
              + f" GFLOP/s; seqlab+accel's MFU against the largest: {accel['mfu_vs_largest_square']:.1%}")
    if args.gemm_table:
        for precision, t in tables.items():
            print(f"\n{precision} weight products of one step, ms (median of 5; x = layers with that shape)")
            print_gemm_table(t)
    ceilings = {}
    for precision, floor in floors.items():
        hf_step = next(r["step_s"] for r in results if r["precision"] == precision and r["library"] == "hf")
        ceilings[precision] = hf_step / floor
        print(f"{precision}: weight GEMMs alone take {floor * 1e3:.1f} ms per step, each on its faster "
              f"library (the floor for any implementation); HF's step / floor = {ceilings[precision]:.2f}x is the largest possible speed-up")
    out = {"config": vars(args), "flops_per_token": flops_tok, "matmul_peak_flops": peaks,
           "square_product_flops": {p: {str(n): v for n, v in r.items()} for p, r in squares.items()}, "results": results,
           "weight_gemm_floor_s": floors, "gemm_table_ms": tables, "max_possible_speedup_vs_hf": ceilings,
           "speedup_vs_hf": speedups, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
           "threads": torch.get_num_threads(), "isa": args.isa_child,
           "accel_plans": plans}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

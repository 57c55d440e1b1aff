"""Decode speed and memory of quantised SmolLM2-135M-Instruct, side by side with fp32 seqlab and HF, one run.

    python bench/quant_speed.py [--new-tokens 32] [--repeats 3] [--no-hf] [--no-rss] [--isa native,avx2]

Columns, measured interleaved in one process (the machine is shared: only ratios from one run mean anything):
``hf`` (transformers fp32 from the same GGUF), ``seqlab`` (fp32 weights, the default dtype: where bf16 is native
and measures faster, ``auto`` takes bf16 products for a long prompt's prefill, so its TTFT is the default's, not an
fp32 one), ``gguf`` (``load_gguf(quant="gguf")``: the
file's Q4_1/Q8_0 blocks), ``int8`` (groups of 32, the default) and ``int4`` (g64), the last two re-quantised from the
dense model; every seqlab column accelerated for batch-1 decode as ``seqlab chat [--quant ...]`` runs it
(``accelerate(model, "decode", rows=1, dtype="auto")``: the fused decode step where it measures faster). Decode tok/s = ``new / (t(1 + new tokens) - t(1 token))`` at
batch 1 and 8 (EOS off); TTFT on a 512-token prompt. Bytes per token: every weight a decode step reads (all
linear layers incl. the LM head, at their stored width) and that over the step time, against a measured DRAM
read bandwidth (a 512 MiB ``sum``). Peak RSS: each implementation in its own subprocess (VmHWM), load + TTFT
prompt + 32 decode steps (the larger of the load window and the request's window; both are written too). The
seqlab workers import no ``transformers`` (about 145 MiB of RSS that a seqlab process does not have).
llama.cpp (llama-cpp-python, run by the interpreter ``--llama-python`` names, in its own process) is a column when
given; if it fails, the JSON says how.
Where the CPU has more than AVX2, ``--isa`` (default both) runs the whole matrix natively and again under the
AVX2 caps, one child process each (``bench/isa_matrix.py``); the JSON then holds ``{"by_isa": {isa: results}}``.
Writes ``bench/results/quant_speed.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import check_count_list, check_positive, status_mib  # noqa: E402
from isa_matrix import add_isa_options, run_per_isa, strip_isa_args  # noqa: E402
from real_models_smollm2 import _quiet, _time, chat_batch, long_prompt, runners  # noqa: E402

from seqlab.cli.chat import packaged_smollm2  # noqa: E402
from seqlab.io import load_gguf  # noqa: E402
from seqlab.accel import accelerate  # noqa: E402
from seqlab.quant import QuantLinear, quantize  # noqa: E402
from seqlab.runtime import atomic_write_text  # noqa: E402


def load(impl: str, path: Path):
    if impl == "hf":
        _quiet()
        from transformers import AutoModelForCausalLM  # optional heavy dependency

        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    if impl == "gguf":
        model = load_gguf(path, quant="gguf", with_tokenizer=False)[0]
    else:
        model = load_gguf(path, with_tokenizer=False)[0]
        if impl != "seqlab":
            model = quantize(model, bits=8 if impl == "int8" else 4, group_size=None if impl == "int8" else 64)
    return accelerate(model, "decode", rows=1, dtype="auto")  # as `seqlab chat [--quant ...]` runs it


def weight_bytes(model) -> int:
    """Bytes one decode step reads from linear weights (the quantised buffers, or the dense/packed fp32)."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += sum(t.numel() * t.element_size() for t in (m.qweight, m.scales, m.mins) if t is not None)
        elif hasattr(m, "in_features") and hasattr(m, "out_features") and not isinstance(m, QuantLinear):
            total += m.in_features * m.out_features * 4
    return total


def dram_read_gbs() -> float:
    x = torch.ones(128 << 20)  # 512 MiB
    x.sum()
    best = min(_time(lambda: x.sum()) for _ in range(5))
    return x.numel() * 4 / best / 1e9


_LLAMA_CPP = """
import json, statistics, sys, time
from llama_cpp import Llama
path, threads, new, reps, ttft_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
chat = "<|im_start|>user\\nWhat is the capital of France?<|im_end|>\\n<|im_start|>assistant\\n"
ids = llm.tokenize(chat.encode(), add_bos=False, special=True)
def run(prompt, k):  # prefill, then k greedy tokens, each fed back: one decode step each
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    for _ in range(k):
        llm.eval([llm.sample(top_k=1, temp=0.0)])
    return time.perf_counter() - t0
run(ids, 4)
steps = [(run(ids, new + 1) - run(ids, 1)) / new for _ in range(reps)]
long = (ids * (ttft_len // len(ids) + 1))[:ttft_len]
run(long, 0)
ttft = [run(long, 0) for _ in range(reps)]
print(json.dumps({"status": "ok", "ms_per_step": statistics.median(steps) * 1e3, "tok_s": 1 / statistics.median(steps),
                  "ttft_ms": statistics.median(ttft) * 1e3, "samples_ms": [x * 1e3 for x in steps]}))
"""


def llama_cpp_column(path: Path, new_tokens: int, python: str | None, repeats: int, ttft_len: int) -> dict:
    """llama.cpp (through llama-cpp-python) on the same GGUF file, batch 1, in its own interpreter ``python``
    (a bench-only peer: it is never a seqlab dependency). Decode as for the other columns: (t(1 + new) - t(1)) / new,
    each token sampled greedily and fed back; TTFT on a ``ttft_len``-token prompt."""
    if python is None:
        return {"status": "not run (pass --llama-python PYTHON: an interpreter with llama-cpp-python installed)"}
    res = subprocess.run([python, "-c", _LLAMA_CPP, str(path), str(torch.get_num_threads()), str(new_tokens),
                          str(repeats), str(ttft_len)], capture_output=True, text=True)
    if res.returncode != 0:  # report how it failed instead of hiding the column
        return {"status": f"failed (exit {res.returncode}): {res.stderr.strip()[-400:]}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def rss_worker(impl: str, path: Path, ttft_len: int) -> None:
    """Peak RSS of load + tokenizer + a ``ttft_len`` prefill and 32 decode steps, in MiB.

    Two windows, because ``generate_output`` starts a new VmHWM window per request (``seqlab.eval.timing``):
    ``load`` is the process's peak up to the end of loading, read before generating; ``generate`` is the peak
    of the request. ``peak_rss_mib`` is the larger, the whole run's peak.
    """
    model = load(impl, path)
    tok = _tokenizer(path)
    ids = long_prompt(tok, ttft_len)
    load_peak, loaded = status_mib("VmHWM"), status_mib("VmRSS")
    fn = runners(None if impl == "hf" else model, model if impl == "hf" else None, ids, torch.ones_like(ids))
    _time(fn["hf" if impl == "hf" else "seqlab"](32))
    gen_peak = status_mib("VmHWM")
    print(json.dumps({"peak_rss_mib": max(load_peak, gen_peak), "load_peak_mib": load_peak, "loaded_mib": loaded,
                      "generate_peak_mib": gen_peak}))


def _tokenizer(path: Path):
    from seqlab.io.gguf import read_gguf
    from seqlab.io.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(read_gguf(path).metadata)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ttft-len", type=int, default=512)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-rss", action="store_true")
    ap.add_argument("--rss-impls", default=None, help="comma list (default: every column)")
    ap.add_argument("--rss-worker", help=argparse.SUPPRESS)
    ap.add_argument("--llama-python", default=None,
                    help="a Python interpreter with llama-cpp-python installed (its own venv): adds llama.cpp as a column")
    ap.add_argument("--out", default="bench/results/quant_speed.json")
    add_isa_options(ap)
    args = ap.parse_args(argv)
    check_positive(ap, args, ("new_tokens", "repeats", "ttft_len"))
    check_count_list(ap, "--batches", args.batches)
    path = packaged_smollm2()
    if args.rss_worker:
        rss_worker(args.rss_worker, path, args.ttft_len)
        return 0
    if args.isa_child is None:  # the parent: one child per ISA (the caps are read when torch loads)
        run_per_isa(__file__, strip_isa_args(sys.argv[1:] if argv is None else argv), args.isa, args.out)
        return 0
    tok = _tokenizer(path)
    impls = ([] if args.no_hf else ["hf"]) + ["seqlab", "gguf", "int8", "int4"]
    models = {name: load(name, path) for name in impls}
    out: dict = {"isa": args.isa_child, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "threads": torch.get_num_threads(), "dram_read_gb_s": dram_read_gbs(), "decode": [], "ttft": []}
    print(f"DRAM read bandwidth {out['dram_read_gb_s']:.1f} GB/s", flush=True)
    for batch in map(int, args.batches.split(",")):
        ids, mask = chat_batch(tok, batch)
        fns = {}
        for name, m in models.items():
            r = runners(None if name == "hf" else m, m if name == "hf" else None, ids, mask)
            fns[name] = r["hf" if name == "hf" else "seqlab"]
        for fn in fns.values():
            fn(4)(), fn(1)()
        samples = {k: [] for k in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                full, one = _time(fn(args.new_tokens + 1)), _time(fn(1))
                samples[name].append((full - one) / args.new_tokens)
        for name, s in samples.items():
            step = statistics.median(s)
            if step <= 0:  # t(1 + n) - t(1) below the timings' noise: no step time can be read off it
                out["decode"].append({"batch": batch, "impl": name, "tok_s": None, "samples_ms": [x * 1e3 for x in s]})
                print(f"batch {batch} {name:14s} n/a: t(1 + {args.new_tokens}) - t(1) was not positive (noise); "
                      f"give more --new-tokens or --repeats", flush=True)
                continue
            wb = weight_bytes(models[name]) if name != "hf" else None
            row = {"batch": batch, "impl": name, "tok_s": batch / step, "ms_per_step": step * 1e3,
                   "weight_bytes_per_step": wb, "weight_gb_s": wb / step / 1e9 if wb else None,
                   "samples_ms": [x * 1e3 for x in s]}
            out["decode"].append(row)
            print(f"batch {batch} {name:14s} {row['tok_s']:7.1f} tok/s {row['ms_per_step']:7.2f} ms/step"
                  + (f"  weights {wb / 2**20:6.1f} MiB/step = {row['weight_gb_s']:.1f} GB/s" if wb else ""), flush=True)
    ids = long_prompt(tok, args.ttft_len)
    fns = {n: runners(None if n == "hf" else m, m if n == "hf" else None, ids, torch.ones_like(ids))
           ["hf" if n == "hf" else "seqlab"] for n, m in models.items()}
    for fn in fns.values():  # one untimed prefill of this length each: first-use costs (new kernels, scratch) out
        fn(1)()
    t = {k: [] for k in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            t[name].append(_time(fn(1)))
    for name, s in t.items():
        out["ttft"].append({"impl": name, "prompt_len": args.ttft_len, "ms": statistics.median(s) * 1e3})
        print(f"TTFT {args.ttft_len} {name:14s} {statistics.median(s) * 1e3:8.1f} ms", flush=True)
    base = {r["batch"]: r["tok_s"] for r in out["decode"] if r["impl"] == ("hf" if "hf" in models else "seqlab")}
    for r in out["decode"]:
        r["x_vs_base"] = r["tok_s"] / base[r["batch"]] if r["tok_s"] and base[r["batch"]] else None
    del models
    out["llama_cpp"] = llama_cpp_column(path, args.new_tokens, args.llama_python, args.repeats, args.ttft_len)
    lc = out["llama_cpp"]
    print("llama-cpp-python (batch 1):", lc["status"], *([f"{lc['tok_s']:.1f} tok/s, {lc['ms_per_step']:.2f} ms/step, "
                                                         f"TTFT {args.ttft_len} {lc['ttft_ms']:.1f} ms"]
                                                       if lc["status"] == "ok" else []), flush=True)
    if not args.no_rss:
        out["peak_rss_mib"] = {}
        for impl in (args.rss_impls.split(",") if args.rss_impls else impls):
            res = subprocess.run([sys.executable, __file__, "--rss-worker", impl, "--ttft-len", str(args.ttft_len)],
                                 capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            row = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else {}
            mib = row.get("peak_rss_mib")
            out["peak_rss_mib"][impl] = mib
            out.setdefault("peak_rss_windows_mib", {})[impl] = {k: v for k, v in row.items() if k != "peak_rss_mib"}
            print(f"peak RSS {impl:14s} {mib} MiB {out['peak_rss_windows_mib'][impl]}"
                  + ("" if mib else f" (failed: {res.stderr[-300:]})"), flush=True)
    atomic_write_text(args.out, json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

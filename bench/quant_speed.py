"""Decode speed and memory of quantised SmolLM2-135M-Instruct, side by side with fp32 seqlab and HF, one run.

    python bench/quant_speed.py [--new-tokens 32] [--repeats 3] [--no-hf] [--no-rss]

Columns, measured interleaved in one process (the machine is shared: only ratios from one run mean anything):
``hf`` (transformers fp32 from the same GGUF), ``seqlab`` (fp32 with the routes ``seqlab.accel`` measured for batch-1 decode, as ``seqlab chat`` runs it),
``gguf`` (``load_gguf(quant="gguf")``: the file's Q4_1/Q8_0 blocks), ``int8`` (groups of 32, the default) and ``int4`` (g64),
the last two re-quantised from the dense model. Decode tok/s = ``new / (t(1 + new tokens) - t(1 token))`` at
batch 1 and 8 (EOS off); TTFT on a 512-token prompt. Bytes per token: every weight a decode step reads (all
linear layers incl. the LM head, at their stored width) and that over the step time, against a measured DRAM
read bandwidth (a 512 MiB ``sum``). Peak RSS: each implementation in its own subprocess (VmHWM), load + TTFT
prompt + 32 decode steps (the larger of the load window and the request's window; both are written too). The
seqlab workers import no ``transformers`` (about 145 MiB of RSS that a seqlab process does not have).
llama-cpp-python is a column when it is installed and runs.
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
        return load_gguf(path, quant="gguf", with_tokenizer=False)[0]
    model = load_gguf(path, with_tokenizer=False)[0]
    if impl == "seqlab":
        accelerate(model, "decode", rows=1, dtype=None)
        return model
    return quantize(model, bits=8 if impl == "int8" else 4, group_size=None if impl == "int8" else 64)


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


def llama_cpp_column(path: Path, new_tokens: int) -> dict:
    try:
        from llama_cpp import Llama  # optional: only if its wheel is installed
    except ImportError as e:
        return {"status": f"not installed ({e})"}
    try:
        llm = Llama(model_path=str(path), n_threads=torch.get_num_threads(), verbose=False)
        t0 = time.perf_counter()
        llm("The capital of France is", max_tokens=new_tokens)
        return {"status": "ok", "tok_s_incl_prefill": new_tokens / (time.perf_counter() - t0)}
    except Exception as e:  # report how it failed instead of hiding the column
        return {"status": f"failed: {type(e).__name__}: {e}"}


def _status_mib(field: str) -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def rss_worker(impl: str, path: Path, ttft_len: int) -> None:
    """Peak RSS of load + tokenizer + a ``ttft_len`` prefill and 32 decode steps, in MiB.

    Two windows, because ``generate_output`` starts a new VmHWM window per request (``seqlab.eval.timing``):
    ``load`` is the process's peak up to the end of loading, read before generating; ``generate`` is the peak
    of the request. ``peak_rss_mib`` is the larger, the whole run's peak.
    """
    model = load(impl, path)
    tok = _tokenizer(path)
    ids = long_prompt(tok, ttft_len)
    load_peak, loaded = _status_mib("VmHWM"), _status_mib("VmRSS")
    fn = runners(None if impl == "hf" else model, model if impl == "hf" else None, ids, torch.ones_like(ids))
    _time(fn["hf" if impl == "hf" else "seqlab"](32))
    gen_peak = _status_mib("VmHWM")
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
    ap.add_argument("--out", default="bench/results/quant_speed.json")
    args = ap.parse_args(argv)
    path = packaged_smollm2()
    if args.rss_worker:
        rss_worker(args.rss_worker, path, args.ttft_len)
        return 0
    tok = _tokenizer(path)
    impls = ([] if args.no_hf else ["hf"]) + ["seqlab", "gguf", "int8", "int4"]
    models = {name: load(name, path) for name in impls}
    out: dict = {"threads": torch.get_num_threads(), "dram_read_gb_s": dram_read_gbs(), "decode": [], "ttft": []}
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
    t = {k: [] for k in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            t[name].append(_time(fn(1)))
    for name, s in t.items():
        out["ttft"].append({"impl": name, "prompt_len": args.ttft_len, "ms": statistics.median(s) * 1e3})
        print(f"TTFT {args.ttft_len} {name:14s} {statistics.median(s) * 1e3:8.1f} ms", flush=True)
    base = {r["batch"]: r["tok_s"] for r in out["decode"] if r["impl"] == ("hf" if "hf" in models else "seqlab")}
    for r in out["decode"]:
        r["x_vs_base"] = r["tok_s"] / base[r["batch"]]
    del models
    out["llama_cpp"] = llama_cpp_column(path, args.new_tokens)
    print("llama-cpp-python:", out["llama_cpp"]["status"], flush=True)
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

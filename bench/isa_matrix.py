"""Run one bench script natively and under the AVX2 caps, one child process per instruction set, in one command.

The caps (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2``, and
``OPENBLAS_CORETYPE=Haswell`` for numpy's BLAS) are read when torch and numpy load, so each ISA needs its own
process. Each child gets a fresh accelerator calibration cache (a temporary folder), so the routes it measures are
chosen under its own conditions, and writes its JSON to a temporary file; the parent collects them into
``{"by_isa": {isa: results}}`` at ``--out``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from seqlab.runtime.cpu import AVX2_CAPS

# numpy's OpenBLAS picks its kernels by its own CPU detection, which the three caps do not reach: on an AMX Xeon
# under them its 2048-square sgemm ran at 326 GFLOP/s (AVX-512 kernels), 220 with this (MKL's AVX2 rate: 234).
BENCH_AVX2_CAPS = AVX2_CAPS | {"OPENBLAS_CORETYPE": "Haswell"}


def default_isas() -> str:
    """``native,avx2`` where the CPU has more than AVX2 (AVX-512 or AMX), else ``native``."""
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return "native"
    return "native,avx2" if (" avx512f" in flags or " amx_tile" in flags) else "native"


def add_isa_options(ap) -> None:
    ap.add_argument("--isa", default=default_isas(),
                    help="comma list of native, avx2 (default: both where the CPU has more than AVX2)")
    ap.add_argument("--isa-child", default=None, help="(internal) run this one ISA in this process")


def run_per_isa(script: str, argv: list[str], isas: str, out: str) -> dict:
    """Run ``script argv`` once per ISA in ``isas``; print each child's output; write and return the collection."""
    collected: dict = {"by_isa": {}}
    unknown = [isa for isa in isas.split(",") if isa not in ("native", "avx2")]
    if unknown:  # before the first ISA's run, which takes minutes
        sys.exit(f"--isa: unknown instruction set {unknown[0]!r} (native, avx2)")
    with tempfile.TemporaryDirectory(prefix="seqlab-bench-") as tmp:
        for isa in isas.split(","):
            env = {**os.environ, "SEQLAB_ACCEL_CACHE": str(Path(tmp) / f"cache-{isa}")}
            if isa == "avx2":
                env |= BENCH_AVX2_CAPS
            child_out = Path(tmp) / f"{isa}.json"
            print(f"\n## ISA: {isa}", flush=True)
            subprocess.run([sys.executable, script, *argv, "--isa-child", isa, "--out", str(child_out)], env=env,
                           check=True)
            collected["by_isa"][isa] = json.loads(child_out.read_text())
    write_json(out, collected)
    print(f"wrote {out}", file=sys.stderr)
    return collected


def strip_isa_args(argv: list[str]) -> list[str]:
    """``argv`` without ``--isa X`` / ``--out X`` (the parent sets both for each child)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--isa", "--out"):
            skip = True
            continue
        if a.startswith(("--isa=", "--out=")):
            continue
        out.append(a)
    return out


def parent_or_child(script: str, args, measure: Callable[[], dict], table: Callable[[dict], str]) -> None:
    """A bench's ``main`` after parsing: as the parent, one child per ISA, then every table again; as a child,
    ``measure()``, print its table and write the result (with ``isa`` and ``table_markdown``) to ``args.out``."""
    if args.isa_child is None:
        res = run_per_isa(script, strip_isa_args(sys.argv[1:]), args.isa, args.out)
        for isa, r in res["by_isa"].items():
            print(f"\n### {isa}\n{r['table_markdown']}")
        return
    result = measure()
    result["isa"] = args.isa_child
    result["table_markdown"] = table(result)
    print(result["table_markdown"])
    write_json(args.out, result)


def write_json(out: str | Path, obj: dict) -> None:
    """``obj`` as indented JSON at ``out``, whole or not at all (a temporary file, then a rename)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, out)

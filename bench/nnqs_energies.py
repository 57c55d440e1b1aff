"""NNQS energies vs FCI for H2O, NH3 and N2 (STO-3G, Choo et al. geometries) on this machine's CPUs.

Each molecule runs through exactly the code path of ``seqlab nnqs`` (the CLI's ``run``), so the numbers are what a
user gets. Prints a table and writes bench/results/nnqs_energies.json.

    python bench/nnqs_energies.py                          # h2o nh3 n2 with the per-molecule steps below
    python bench/nnqs_energies.py --molecules h2o --steps 400
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from seqlab.cli import nnqs as cli_nnqs

DEFAULT_STEPS = {"h2": 100, "lih": 300, "h2o": 400, "nh3": 600, "n2": 800, "c2": 1000}


def run_one(name: str, steps: int, samples: float, mode: str, out: Path, extra: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    cli_nnqs.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["nnqs", "--molecule", name, "--steps", str(steps), "--samples", str(samples),
                              "--local-energy", mode, "--out", str(out / name), "--quiet", *extra])
    t = time.perf_counter()
    cli_nnqs.run(args)
    res = json.loads((out / name / "result.json").read_text())
    res["bench_wall_s"] = time.perf_counter() - t
    return res


def _mha(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--molecules", nargs="+", default=["h2o", "nh3", "n2"])
    ap.add_argument("--steps", type=int, default=None, help="override the per-molecule defaults")
    ap.add_argument("--samples", type=float, default=1e10)
    ap.add_argument("--local-energy", default="exact", choices=("exact", "sample-space"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/bench_nnqs", help="runs go to OUT/<date-time>/<molecule> (never reused)")
    ap.add_argument("--json", default="bench/results/nnqs_energies.json")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="further `seqlab nnqs` flags after --")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    extra = [x for x in a.extra if x != "--"]
    rows = []
    out = Path(a.out) / time.strftime("%Y%m%d-%H%M%S")
    for name in a.molecules:
        steps = a.steps or DEFAULT_STEPS.get(name, 600)
        r = run_one(name, steps, a.samples, a.local_energy, out, extra)
        rows.append(r)
        print(f"{name}: {r['error_mha']:+.3f} mHa in {r['wall_time_s']:.0f} s", flush=True)
    hdr = f"{'molecule':<9}{'n_so':>5}{'dets':>8}{'E_FCI':>15}{'E_NNQS':>15}{'err mHa':>10}{'chem.acc':>9}" \
          f"{'CCSD(T) err':>12}{'steps':>7}{'N_s':>8}{'E_loc':>13}{'wall s':>8}"
    print(hdr)
    for r in rows:
        ok = r["error_mha"] is not None and abs(r["error_mha"]) < 1.6
        print(f"{r['molecule']:<9}{r['n_spin_orbitals']:>5}{r['n_configurations']:>8}{r['e_fci']:>15.6f}"
              f"{r['energy']:>15.6f}{r['error_mha']:>10.3f}{'yes' if ok else 'NO':>9}"
              f"{_mha(r.get('e_ccsd_t_error_mha')):>12}{r['steps']:>7}"
              f"{r['samples']:>8.0e}{r['local_energy']:>13}{r['wall_time_s']:>8.0f}")
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": a.threads,
            "torch": torch.__version__, "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M")}
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""NNQS energies vs FCI for built-in molecules and seeds (STO-3G, Choo et al. geometries) on this machine's CPUs.

Each run is the CLI a user types (``seqlab nnqs --molecule NAME --seed S``, defaults unless flags are given after
``--``), one process per run, ``--jobs`` at once. Prints a table and writes bench/results/nnqs_energies.json.

    python bench/nnqs_energies.py --molecules n2 c2 --seeds 0 1 2 --jobs 2 --threads 1
    python bench/nnqs_energies.py --molecules h2o --seeds 0 -- --steps 400 --samples 1e5
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from nnqs_runs import mha, run_all, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--molecules", nargs="+", default=["lih", "h2o", "n2"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each its own process)")
    ap.add_argument("--out", default="runs/bench_nnqs", help="runs go to OUT/<date-time>/<molecule>-s<seed>")
    ap.add_argument("--json", default="bench/results/nnqs_energies.json")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="further `seqlab nnqs` flags after --")
    a = ap.parse_args()
    extra = [x for x in a.extra if x != "--"]
    out = Path(a.out) / time.strftime("%Y%m%d-%H%M%S")
    jobs = [(["--molecule", name, "--seed", str(seed), *extra], out / f"{name}-s{seed}")
            for name in a.molecules for seed in a.seeds]
    rows = run_all(jobs, a.threads, a.jobs)
    print(f"{'molecule':<9}{'seed':>5}{'n_so':>5}{'dets':>8}{'E_FCI':>15}{'E_NNQS':>15}{'err mHa':>10}"
          f"{'chem.acc':>9}{'CCSD(T) err':>12}{'steps':>7}{'wall s':>8}")
    for r in rows:
        ok = r["error_mha"] is not None and abs(r["error_mha"]) < 1.6
        print(f"{r['molecule']:<9}{r['seed']:>5}{r['n_spin_orbitals']:>5}{r['n_configurations']:>8}"
              f"{r['e_fci']:>15.6f}{r['energy']:>15.6f}{r['error_mha']:>10.3f}{'yes' if ok else 'NO':>9}"
              f"{mha(r.get('e_ccsd_t_error_mha')):>12}{r['steps']:>7}{r['wall_time_s']:>8.0f}")
    print(f"wrote {write_json(a.json, rows, a.threads, a.jobs)}")


if __name__ == "__main__":
    main()

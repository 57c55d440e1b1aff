"""NNQS across processes: the time of a VMC step on 1 and on 2 ``torchrun`` ranks at the same N_s (same total work).

Each configuration runs the CLI a user types (``seqlab nnqs`` or ``torchrun --nproc-per-node 2 -m seqlab.cli.nnqs``,
1 torch thread per rank) and reads the per-step times from energies.jsonl: sampling, local energy, backward + update,
medians over the steps after the first few. The sampled estimator splits the sample tree over the ranks; the exact
sum splits only the gradient set (every rank walks the whole sector itself), so its speed-up is smaller by design.

    python bench/nnqs_ranks.py                       # N2, sampled N_s = 3 000 and the exact sum; 1 and 2 ranks
    python bench/nnqs_ranks.py --molecule lih --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from nnqs_runs import write_json

PARTS = ("t_sample", "t_local_energy", "t_backward")


def run(ranks: int, args: list[str], out: Path) -> dict:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                if ranks > 1 else [sys.executable])
    cmd = [*launcher, "-m", "seqlab.cli.nnqs", *args, "--threads", "1", "--quiet", "--no-fci", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "energies.jsonl").read_text().splitlines()][3:]  # warm-up steps out
    med = {k: statistics.median(r[k] for r in rows) for k in PARTS}
    return {"ranks": ranks, "command": " ".join(cmd[len(launcher):]), **med, "step_s": sum(med.values()),
            "n_unique": statistics.median(r["n_unique"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--molecule", default="n2")
    ap.add_argument("--samples", type=float, default=3000, help="N_s of the sampled rows (over all ranks)")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--json", default="bench/results/nnqs_ranks.json")
    a = ap.parse_args()
    common = ["--molecule", a.molecule, "--steps", str(a.steps), "--warm-start-steps", "50"]
    cases = {"sampled": [*common, "--estimator", "sampled", "--samples", f"{int(a.samples)}"],
             "exact-sum": [*common, "--estimator", "exact-sum"]}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in cases.items():
            for ranks in (1, 2):
                row = {"estimator": name, **run(ranks, args, Path(tmp) / f"{name}-{ranks}")}
                rows.append(row)
    print(f"{'estimator':<10}{'ranks':>6}{'unique':>8}" + "".join(f"{k[2:]:>14}" for k in PARTS) + f"{'step':>9}"
          + f"{'speed-up':>10}")
    for row in rows:
        base = next(r for r in rows if r["estimator"] == row["estimator"] and r["ranks"] == 1)
        row["speedup"] = base["step_s"] / row["step_s"]
        print(f"{row['estimator']:<10}{row['ranks']:>6}{row['n_unique']:>8.0f}"
              + "".join(f"{row[k]:>14.3f}" for k in PARTS) + f"{row['step_s']:>9.3f}{row['speedup']:>9.2f}x")
    print(f"wrote {write_json(a.json, rows, 1, 1)}")


if __name__ == "__main__":
    main()

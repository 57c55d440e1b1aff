"""N2 dissociation curve (STO-3G): NNQS against HF, CCSD, CCSD(T) and FCI on the same orbitals at each bond length.

Stretched N2 is where CCSD(T) fails (its error grows past chemical accuracy as the triple bond breaks). Each point is
``seqlab nnqs --atom "N 0 0 0; N 0 0 R" --seed S`` (the CLI defaults unless flags follow ``--``), ``--jobs`` at
once. Writes bench/results/nnqs_curve.json and a two-panel PNG: energies against R, and |E - E_FCI| on a log axis
with the 1.6 mHa line.

    python bench/nnqs_curve.py --jobs 2 --threads 1
    python bench/nnqs_curve.py --bonds 1.0 2.0 -- --steps 300
    python bench/nnqs_curve.py --collect runs/bench_nnqs_curve/DATE   # table, JSON and plot of an earlier scan
"""

from __future__ import annotations

import argparse
import io
import json
import shlex
import time
from pathlib import Path

from nnqs_runs import mha, run_all, write_json

from seqlab.nnqs.driver import CHEMICAL_ACCURACY_MHA
from seqlab.nnqs.molecules import get_molecule
from seqlab.nnqs.references import prepare
from seqlab.runtime import atomic_write_bytes

METHODS = (("HF", "e_hf"), ("CCSD", "e_ccsd"), ("CCSD(T)", "e_ccsd_t"), ("NNQS", "energy"), ("FCI", "e_fci"))


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure  # heavy (seconds to import): only the plot needs it

    fig = Figure(figsize=(7, 7))
    top, bottom = fig.subplots(2, 1, sharex=True)
    r = [row["bond_angstrom"] for row in rows]
    for name, key in METHODS:
        top.plot(r, [row[key] for row in rows], "o-" if name in ("NNQS", "FCI") else ".--", label=name)
        if name != "FCI":
            err = [abs(row[key] - row["e_fci"]) * 1000 if row[key] is not None else float("nan") for row in rows]
            bottom.semilogy(r, err, "o-" if name == "NNQS" else ".--", label=name)
    bottom.axhline(CHEMICAL_ACCURACY_MHA, color="grey", lw=0.8, label="chemical accuracy 1.6 mHa")
    top.set_ylabel("energy (Ha)")
    top.set_title("N2 / STO-3G dissociation")
    top.legend()
    bottom.set_ylabel("|E - E_FCI| (mHa)")
    bottom.set_xlabel("N-N distance (Angstrom)")
    bottom.legend(fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())


def collect(run: Path, bond: float, seed: int) -> dict:
    """One point of a scan, as ``run_all`` reports it (result.json plus the command that made it). A point still
    running (or stopped) has no result.json: its last logged step stands in, with the references recomputed on the
    same geometry and ``unfinished_at_step`` set, so a partial curve says exactly how far each point got."""
    atom = f"N 0 0 0; N 0 0 {bond}"
    command = f"seqlab nnqs --atom {shlex.quote(atom)} --seed {seed}"
    path = run / "result.json"
    if path.is_file():
        return {**json.loads(path.read_text()), "command": command}
    log = run / "energies.jsonl"
    if not log.is_file():
        raise SystemExit(f"{run}: neither result.json nor energies.jsonl (that point never started)")
    last = json.loads(log.read_text().splitlines()[-1])
    refs = prepare(get_molecule(atom=atom)).references
    return {"atom": atom, "seed": seed, "command": command, "energy": last["energy"], "e_hf": refs.e_hf,
            "e_ccsd": refs.e_ccsd, "e_ccsd_t": refs.e_ccsd_t, "e_fci": refs.e_fci,
            "error_mha": (last["energy"] - refs.e_fci) * 1000, "unfinished_at_step": last["step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bonds", nargs="+", type=float, default=[1.0, 1.2, 1.6, 2.0, 2.4], help="N-N distances (Å)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each its own process)")
    ap.add_argument("--out", default="runs/bench_nnqs_curve", help="runs go to OUT/<date-time>/r<R>")
    ap.add_argument("--json", default="bench/results/nnqs_curve.json")
    ap.add_argument("--png", default="bench/results/nnqs_n2_curve.png")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="further `seqlab nnqs` flags after --")
    ap.add_argument("--collect", metavar="DIR", help="run nothing: read DIR/r<R>/result.json of an earlier (or "
                    "interrupted, then completed by hand) scan and write the table, JSON and plot")
    a = ap.parse_args()
    extra = [x for x in a.extra if x != "--"]
    if a.collect:
        rows = [collect(Path(a.collect) / f"r{r}", r, a.seed) for r in a.bonds]
    else:
        out = Path(a.out) / time.strftime("%Y%m%d-%H%M%S")
        jobs = [(["--atom", f"N 0 0 0; N 0 0 {r}", "--seed", str(a.seed), *extra], out / f"r{r}") for r in a.bonds]
        rows = run_all(jobs, a.threads, a.jobs)
    for r, row in zip(a.bonds, rows):
        row["bond_angstrom"] = r
    rows.sort(key=lambda row: row["bond_angstrom"])  # run hardest-first if you like; report in order of R
    print(f"{'R (Å)':>6}{'E_FCI':>15}" + "".join(f"{name + ' err':>14}" for name, _ in METHODS[:-1]))
    for row in rows:
        errs = [None if row[k] is None else (row[k] - row["e_fci"]) * 1000 for _, k in METHODS[:-1]]
        partial = f"   (unfinished: step {row['unfinished_at_step']})" if "unfinished_at_step" in row else ""
        print(f"{row['bond_angstrom']:>6.2f}{row['e_fci']:>15.6f}" + "".join(f"{mha(e):>14}" for e in errs) + partial)
    plot(rows, Path(a.png))
    print(f"wrote {write_json(a.json, rows, a.threads, a.jobs)} and {a.png}")


if __name__ == "__main__":
    main()

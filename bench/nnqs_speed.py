"""NNQS speed: sampling with vs without the KV cache (N2, 20 spin orbitals), bf16 vs fp32 log P, and the time of
one VMC step split into sampling / local energy / backward+update, for exact local energies on the per-sample
enumeration path and on the sector fast path (H precomputed over the whole sector; see nnqs/local_energy.py).

    python bench/nnqs_speed.py                  # prints a table, writes bench/results/nnqs_speed.json
    python bench/nnqs_speed.py --samples 1e6 --d-model 128 --layers 4
    python bench/nnqs_speed.py --vmc-samples 1e3 1e4 1e10 --vmc-steps 3

The sampler's cost grows with the number of *unique* prefixes, so the table reports it next to each time.
The ansatz is freshly initialised (nearly uniform P: the widest tree, i.e. the first VMC steps).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from seqlab.nnqs.ansatz import AnsatzConfig, Wavefunction
from seqlab.nnqs.molecules import get_molecule
from seqlab.nnqs.references import prepare
from seqlab.nnqs.sampler import SamplerConfig, sample
from seqlab.nnqs.local_energy import SectorHamiltonian
from seqlab.nnqs.vmc import VMCConfig, vmc_step
from seqlab.runtime.dist import DistInfo


def timed(fn, repeats: int, warmup: int = 1) -> tuple[float, object, float]:
    """(median wall s, last output, median CPU s of this process), after ``warmup`` untimed calls (first-use costs:
    kernel selection, allocator growth). On a shared machine the CPU time is the steadier figure; with --threads 1
    it is what an idle core would take."""
    for _ in range(warmup):
        fn()
    times, cpu, out = [], [], None
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(times), out, statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--molecule", default="n2")
    ap.add_argument("--samples", type=float, nargs="+", default=[1e3, 1e5])
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vmc-steps", type=int, default=2, help="timed VMC steps per row, after one untimed first step")
    ap.add_argument("--vmc-samples", type=float, nargs="+", default=[1e3, 1e4, 1e10],
                    help="N_s of the VMC step breakdown (1e10: every configuration sampled, as while annealing)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="bench/results/nnqs_speed.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    system = prepare(get_molecule(a.molecule), fci=False, cc=False)
    ham = system.hamiltonian
    acfg = AnsatzConfig(d_model=a.d_model, n_layers=a.layers, n_heads=a.heads)
    torch.manual_seed(0)
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta, acfg).eval()
    rows = []
    print(f"{a.molecule}: {ham.n_so} spin orbitals, ansatz d_model={a.d_model} layers={a.layers}, "
          f"{sum(p.numel() for p in wf.parameters())} parameters, {a.threads} threads")
    print(f"{'N_s':>8}{'unique':>8}{'cache s':>10}{'no-cache s':>12}{'speed-up':>10}{'cache cpu s':>13}"
          f"{'no-cache cpu s':>16}{'cpu speed-up':>14}")
    for ns in a.samples:
        n = int(ns)
        t_c, s, c_c = timed(lambda: sample(wf, n, torch.Generator().manual_seed(0), SamplerConfig(use_cache=True)),
                       a.repeats)
        t_n, _, c_n = timed(lambda: sample(wf, n, torch.Generator().manual_seed(0), SamplerConfig(use_cache=False)),
                       a.repeats)
        rows.append({"samples": n, "unique": len(s.tokens), "cache_s": t_c, "no_cache_s": t_n, "speedup": t_n / t_c,
                     "cache_cpu_s": c_c, "no_cache_cpu_s": c_n, "cpu_speedup": c_n / c_c})
        print(f"{n:>8.0e}{len(s.tokens):>8}{t_c:>10.3f}{t_n:>12.3f}{t_n / t_c:>9.2f}x{c_c:>13.3f}{c_n:>16.3f}"
              f"{c_n / c_c:>13.2f}x", flush=True)

    # bf16: how far is log P from fp32, and how much faster? (decides whether bf16 may be used at all)
    tok = s.tokens
    with torch.no_grad():
        t32, lp32, c32 = timed(lambda: wf.log_prob(tok), a.repeats)

        def bf16():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return wf.log_prob(tok)

        t16, lp16, c16 = timed(bf16, a.repeats)
    dlp = (lp16.double() - lp32.double()).abs()
    p = lp32.double().exp()
    bf16_row = {"configs": len(tok), "fp32_s": t32, "bf16_s": t16, "fp32_cpu_s": c32, "bf16_cpu_s": c16, "max_abs_dlogP": float(dlp.max()),
                "mean_abs_dlogP": float(dlp.mean()), "rel_err_P_weighted": float((p * dlp).sum() / p.sum())}
    print(f"log P on {len(tok)} configurations: fp32 {t32:.3f} s ({c32:.3f} cpu), bf16 autocast {t16:.3f} s "
          f"({c16:.3f} cpu); "
          f"|dlogP| max {bf16_row['max_abs_dlogP']:.2e}, mean {bf16_row['mean_abs_dlogP']:.2e}")

    # one VMC step, broken down: exact local energies per sample vs on the precomputed sector H
    t_b, sector, c_b = timed(lambda: SectorHamiltonian(ham, progress=False), 1, warmup=0)  # a one-off build
    print(f"sector H: {len(sector)} configurations, {sector.matrix.nnz} nonzeros, built in {t_b:.2f} s "
          f"({c_b:.2f} cpu), {sector.matrix.data.nbytes + sector.matrix.indices.nbytes >> 20} MiB")
    vmc_rows = []
    runs = [(int(ns), e_path, sec, "sampled") for ns in a.vmc_samples
            for e_path, sec in (("per-sample", None), ("sector", sector))]
    runs.append((0, "exact-sum", sector, "exact-sum"))  # no samples: the whole sector with exact weights
    for ns, e_path, sec, estimator in runs:
        cfg = VMCConfig(steps=a.vmc_steps + 1, samples=max(ns, 1), anneal=0.0, estimator=estimator)
        torch.manual_seed(0)
        wf_t = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta, acfg)
        opt = torch.optim.AdamW(wf_t.parameters(), lr=cfg.lr)
        # one untimed first step (first-use costs), then the medians of --vmc-steps more
        steps = [vmc_step(wf_t, ham, opt, cfg, i, DistInfo(), sector=sec) for i in range(a.vmc_steps + 1)][1:]
        br = {k: statistics.median(getattr(st, k) for st in steps)
              for k in ("t_sample", "t_local_energy", "t_backward")}
        br.update(samples=ns or None, path=e_path, n_unique=steps[-1].n_unique,
                  total=br["t_sample"] + br["t_local_energy"] + br["t_backward"])
        vmc_rows.append(br)
        print(f"VMC step (N_s={ns:.0e}, {br['n_unique']} unique, exact E_loc, {e_path}): "
              f"sampling {br['t_sample']:.2f} s, local energy {br['t_local_energy']:.2f} s, "
              f"backward+update {br['t_backward']:.2f} s, total {br['total']:.2f} s", flush=True)
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": a.threads,
            "torch": torch.__version__, "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M"),
            "load_avg": os.getloadavg()}
    out = {"meta": meta, "molecule": a.molecule, "ansatz": acfg.__dict__, "sampling": rows, "bf16": bf16_row,
           "sector_build": {"configurations": len(sector), "nnz": sector.matrix.nnz, "wall_s": t_b, "cpu_s": c_b},
           "vmc_step": vmc_rows}
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

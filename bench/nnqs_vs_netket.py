"""seqlab nnqs side by side with NetKet on the same molecules, orbitals and CPU-time budget.

    python bench/nnqs_vs_netket.py --netket-python /path/to/venv/bin/python [--molecules lih h2o n2] [--seed 0]

For each molecule: ``seqlab nnqs --molecule M --seed S --threads 1`` (its defaults), then NetKet for the same CPU
time (``--budget-scale`` times it), both on one thread: CPU time, so that other jobs on the machine do not tilt the
comparison. NetKet runs in its own interpreter (``--netket-python``: a venv with ``netket`` and
``pyscf``; NetKet is a bench peer, never a seqlab dependency) on the Hamiltonian
``netket.experimental.operator.from_pyscf_molecule`` builds from the same PySCF molecule and the same orbitals
(seqlab's geometry and basis; seqlab's RHF orbitals with degenerate pairs fixed by ``nnqs.orbitals``, handed over in a
``.npy`` file: a fresh ``scf.RHF`` in the peer's process would rotate N2's pi pairs arbitrarily, which changes how
many determinants the state needs) in the fixed-particle-number space ``SpinOrbitalFermions(n_orb, s=1/2,
n_fermions_per_spin=(N_a, N_b))``. Its ansatz is the one NetKet's documentation suggests for molecules, a Slater
determinant with a neural backflow (an MLP of the occupation numbers adds to the orbital matrix), started from the
HF orbitals plus small noise (exactly HF, every other determinant has a zero amplitude and no gradient), summed
exactly over the sector (``FullSumState``, as seqlab's exact-sum estimator) and optimised by SGD with SR.

Workarounds for the peer, as a new user would need them:
- ``FullSumState`` with this operator fails with ``TypeError: unhashable type: 'dict'`` in ``to_sparse_cached``
  (NetKet 3.23): the bench caches the sparse matrix by the operator's identity instead.
- NetKet's autoregressive networks refuse constrained Hilbert spaces, so the backflow determinant is the ansatz.

Error = E - E_FCI (both exact sums: variational; NetKet's is the state it had when the budget ran out), CPU time
after the imports (SCF, references and compilation included; not NetKet's per-step energy read-out for the trace),
parameters; NetKet's error after every step against its CPU time (``trace``).
Writes ``bench/results/nnqs_vs_netket.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from seqlab.nnqs.molecules import get_molecule
from seqlab.nnqs.references import build_pyscf, run_scf

sys.path.insert(0, str(Path(__file__).parent))
from nnqs_runs import mha, run_cli, write_json  # noqa: E402

_NETKET = r"""
import json, os, sys, time
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
import jax
jax.config.update("jax_enable_x64", True)
import flax.linen as nn, jax.numpy as jnp, numpy as np, optax
import netket as nk, netket.experimental as nkx
import netket.vqs.full_summ.expect as full_sum_expect
from pyscf import fci, gto, scf

t0, cpu0 = time.perf_counter(), time.process_time()  # after the imports, as seqlab's cpu_time_s
atom, basis = sys.argv[1], sys.argv[2]
budget, seed, hidden = float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
lr, shift = float(sys.argv[6]), float(sys.argv[7])
mol = gto.M(atom=atom, basis=basis, unit="angstrom", verbose=0)
mf = scf.RHF(mol).run()
e_fci = float(fci.FCI(mf).kernel()[0])
mo = np.load(sys.argv[8])  # seqlab's orbitals: the same Hamiltonian, not just the same energies
if not np.allclose(mo.T @ mol.intor("int1e_ovlp") @ mo, np.eye(mo.shape[1]), atol=1e-8):
    raise SystemExit("the orbitals handed over are not orthonormal for this molecule: a different problem")
ha = nkx.operator.from_pyscf_molecule(mol, mo_coeff=mo)
hi = ha.hilbert
_sparse = {}
full_sum_expect.to_sparse_cached = lambda op: _sparse.setdefault(id(op), op.to_sparse())  # unhashable dict fields

class Backflow(nn.Module):
    # psi(n) = det(M0 + MLP(n))[occupied rows]: a Slater determinant whose orbitals depend on the configuration
    @nn.compact
    def __call__(self, n):
        n_so, (na, nb) = hi.size, hi.n_fermions_per_spin
        n_orb = n_so // 2
        m0 = np.zeros((n_so, na + nb))
        m0[:na, :na] = np.eye(na)  # RHF orbitals in the MO basis: alpha in the first block, beta in the second
        m0[n_orb:n_orb + nb, na:] = np.eye(nb)
        M0 = self.param("M0", lambda k: jnp.asarray(m0) + 0.05 * jax.random.normal(k, m0.shape, jnp.float64))
        dense1 = nn.Dense(hidden, param_dtype=jnp.float64)
        dense2 = nn.Dense(n_so * (na + nb), param_dtype=jnp.float64, kernel_init=nn.initializers.zeros)

        def one(x):
            M = M0 + dense2(jnp.tanh(dense1(x.astype(jnp.float64)))).reshape(n_so, na + nb)
            sign, logdet = jnp.linalg.slogdet(M[jnp.nonzero(x, size=na + nb)[0]])
            return logdet + jnp.log(sign + 0j)
        return jax.vmap(one)(n)

vs = nk.vqs.FullSumState(hi, Backflow(), seed=seed)
driver = nk.driver.VMC(ha, optax.sgd(lr), variational_state=vs, preconditioner=nk.optimizer.SR(diag_shift=shift))
trace, step, best, readout = [], 0, float("inf"), 0.0
t_setup = time.process_time() - cpu0  # SCF and FCI reference, operator (JAX compiles in the first step)
spent, next_readout = 0.0, 0.0  # CPU seconds of NetKet's own work; the energy read-outs for the trace are not charged
while spent < budget:
    driver.run(1, show_progress=False)
    step += 1
    spent = time.process_time() - cpu0 - readout
    if spent < next_readout and spent < budget:  # a read-out costs about a step: one per 1 % of the budget
        continue
    next_readout = spent + budget / 100
    r0 = time.process_time()
    err = (float(vs.expect(ha).mean.real) - e_fci) * 1000
    readout += time.process_time() - r0
    best = min(best, err)
    trace.append([round(spent, 2), err])
at_budget = [e for t, e in trace if t <= budget]  # the state NetKet had when the budget ran out
print(json.dumps({"e_fci": e_fci, "error_mha": at_budget[-1] if at_budget else None,
                  "error_after_last_step_mha": trace[-1][1] if trace else None,
                  "best_error_mha": best if trace else None, "setup_s": t_setup,
                  "steps": step, "cpu_s": spent, "wall_s": time.perf_counter() - t0,
                  "n_parameters": vs.n_parameters,
                  "sector_size": int(hi.n_states), "trace": trace, "hidden": hidden, "lr": lr, "diag_shift": shift}))
"""


def seqlab_orbitals(atom: str, basis: str, path: Path) -> Path:
    """The MO coefficients seqlab's Hamiltonian was built from (``run_scf``: RHF, degenerate blocks fixed), saved
    for the peer's process."""
    pmol = build_pyscf(get_molecule(atom=atom, basis=basis))
    np.save(path, run_scf(pmol).mo_coeff)
    return path


def netket_run(python: str, atom: str, basis: str, budget_s: float, seed: int, hidden: int, lr: float,
               shift: float, orbitals: Path) -> dict:
    res = subprocess.run([python, "-c", _NETKET, atom, basis, str(budget_s), str(seed), str(hidden), str(lr),
                          str(shift), str(orbitals)], capture_output=True, text=True)
    if res.returncode != 0:  # report how it failed instead of hiding the column
        return {"status": f"failed (exit {res.returncode}): {res.stderr.strip()[-600:]}"}
    return {"status": "ok", **json.loads(res.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--netket-python", required=True, help="an interpreter with netket and pyscf installed")
    ap.add_argument("--molecules", nargs="+", default=["lih", "h2o", "n2"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=32, help="NetKet backflow MLP width")
    ap.add_argument("--lr", type=float, default=0.05, help="NetKet SGD learning rate (with SR)")
    ap.add_argument("--diag-shift", type=float, default=1e-4, help="NetKet SR diagonal shift")
    ap.add_argument("--budget-scale", type=float, default=1.0,
                    help="NetKet's CPU time as a multiple of seqlab's (1 = equal time, the comparison)")
    ap.add_argument("--out", default="runs/bench_netket")
    ap.add_argument("--json", default="bench/results/nnqs_vs_netket.json")
    a = ap.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = "1"  # both sides on one thread, PySCF's BLAS and NetKet's numba included
    rows, out = [], Path(a.out) / time.strftime("%Y%m%d-%H%M%S")
    for name in a.molecules:
        ours = run_cli(["--molecule", name, "--seed", str(a.seed)], out / f"{name}-s{a.seed}", threads=1)
        # the budget: seqlab's CPU time (SCF, references, warm start and VMC; one thread); NetKet's clock counts the
        # same span of its own process (SCF, FCI reference, operator, JAX compilation, VMC), after the imports
        orbitals = seqlab_orbitals(ours["atom"], ours["basis"], out / f"{name}-s{a.seed}" / "mo_coeff.npy")
        peer = netket_run(a.netket_python, ours["atom"], ours["basis"], ours["cpu_time_s"] * a.budget_scale, a.seed,
                          a.hidden, a.lr, a.diag_shift, orbitals)
        if peer["status"] == "ok" and abs(peer["e_fci"] - ours["e_fci"]) > 1e-6:
            peer["status"] = f"different problem: NetKet's PySCF FCI {peer['e_fci']} vs seqlab's {ours['e_fci']}"
        kept = ("error_mha", "cpu_time_s", "wall_time_s", "bench_wall_s", "n_parameters", "steps", "n_configurations",
                "command")
        rows.append({"molecule": name, "seqlab": {k: ours[k] for k in kept}, "netket": peer,
                     "netket_budget_scale": a.budget_scale})
        print(f"{name}: seqlab {mha(ours['error_mha'])} mHa in {ours['cpu_time_s']:.0f} s of CPU "
              f"({ours['n_parameters']} parameters); NetKet {peer['status']}"
              + (f" {mha(peer['error_mha'])} mHa (best {mha(peer['best_error_mha'])}) in {peer['cpu_s']:.0f} s of CPU, "
                 f"{peer['steps']} steps ({peer['n_parameters']} parameters)" if peer["status"] == "ok" else ""),
              flush=True)
    print(f"wrote {write_json(a.json, rows, threads=1, parallel=1)}")


if __name__ == "__main__":
    main()

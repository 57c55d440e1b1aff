"""How many configurations the FCI state needs in seqlab's fixed orbitals against random rotations of the same ones.

Degenerate orbitals (N2's pi pairs, NH3's e pair) come out of an eigensolver in an arbitrary rotation. The energy does
not see it; the wavefunction's support does. For each molecule this diagonalises H over the whole sector in the
orbitals ``nnqs.orbitals`` fixes, then in ``--rotations`` random rotations of every degenerate block, and counts the
configurations the ground state needs: above |c|^2 = 1e-14, and for all but 1e-6 and 1e-8 of its weight.

    python bench/nnqs_orbitals.py                          # N2 at 1.19 and 2.0 Angstrom, NH3
    python bench/nnqs_orbitals.py --atoms "N 0 0 0; N 0 0 2.4"
"""

from __future__ import annotations

import argparse

import numpy as np
from scipy.sparse.linalg import eigsh
from scipy.stats import special_ortho_group

from nnqs_runs import write_json
from seqlab.nnqs.hamiltonian import Hamiltonian, mo_integrals
from seqlab.nnqs.local_energy import SectorHamiltonian
from seqlab.nnqs.molecules import get_molecule
from seqlab.nnqs.orbitals import degenerate_blocks
from seqlab.nnqs.references import build_pyscf, run_scf

DEFAULT_SYSTEMS = ("n2", "N 0 0 0; N 0 0 2.0", "nh3")


def support(mf, n_alpha: int, n_beta: int) -> dict:
    """Ground-state energy and the number of configurations it needs, in ``mf``'s orbitals."""
    h1, eri, e_nuc = mo_integrals(mf)
    sector = SectorHamiltonian(Hamiltonian(h1, eri, e_nuc, n_alpha, n_beta), progress=False)
    w, v = eigsh(sector.matrix, k=1, which="SA")
    weights = np.sort(v[:, 0] ** 2)[::-1]
    mass = np.cumsum(weights)
    return {"energy": float(w[0]), "nonzero": int((weights > 1e-14).sum()),
            "for_1-1e-6": int(np.searchsorted(mass, 1 - 1e-6)) + 1,
            "for_1-1e-8": int(np.searchsorted(mass, 1 - 1e-8)) + 1}


def rotated(mf, rng: np.random.Generator):
    """A copy of ``mf`` with every degenerate block turned by a random rotation (another valid SCF answer)."""
    out, coeff = mf.copy(), mf.mo_coeff.copy()
    for idx in degenerate_blocks(mf.mo_energy, mf.mo_occ, 1e-6):
        coeff[:, idx] = coeff[:, idx] @ special_ortho_group.rvs(len(idx), random_state=rng)
    out.mo_coeff = coeff
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--atoms", nargs="+", default=list(DEFAULT_SYSTEMS),
                    help="built-in molecule names or --atom geometries (STO-3G)")
    ap.add_argument("--rotations", type=int, default=2, help="random rotations per molecule")
    ap.add_argument("--json", default="bench/results/nnqs_orbitals.json")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'system':24} {'orbitals':10} {'E (Ha)':>15} {'|c|^2>1e-14':>12} {'1-1e-6':>8} {'1-1e-8':>8}")
    for system in a.atoms:
        mol = get_molecule(system) if system.isalnum() else get_molecule(atom=system, basis="sto-3g")
        mf = run_scf(build_pyscf(mol))
        cases = [("fixed", mf)] + [(f"rotated {k}", rotated(mf, rng)) for k in range(a.rotations)]
        for name, m in cases:
            row = {"system": system, "orbitals": name, **support(m, mol.n_alpha, mol.n_beta)}
            rows.append(row)
            print(f"{system:24} {name:10} {row['energy']:15.9f} {row['nonzero']:12d} {row['for_1-1e-6']:8d} "
                  f"{row['for_1-1e-8']:8d}")
    print(f"wrote {write_json(a.json, rows, 1, 1)}")


if __name__ == "__main__":
    main()

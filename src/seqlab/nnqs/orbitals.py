"""One set of molecular orbitals per molecule: degenerate orbitals and orbital signs fixed by a rule, not by LAPACK.

An eigensolver returns *some* orthonormal basis of a degenerate eigenspace: N2's and C2's pi_x / pi_y pairs, the e
pair of an exactly symmetric NH3. Which one depends on rounding: PySCF's SCF on two threads returned a different pi
rotation on each of three runs of N2 (one thread: the same one each time), and another CPU rounds differently again.
So two processes on one molecule could build Hamiltonians in different orbitals: a resume could meet a Hamiltonian
its checkpoint was not trained on, and "the same seed" was not the same problem on two machines. A rotation inside a
degenerate block changes no energy (HF, CCSD, CCSD(T), FCI are invariant to it), only the basis the wavefunction is
written in, and that matters: a rotated pair spreads the state over configurations that pure p_x / p_y orbitals keep
at zero by symmetry (docs/nnqs.md, "Training recipe").

The rule, for each block of orbitals with the same energy (within ``tol``) and occupation:
- pivots: greedily, the atomic orbital with the largest weight left in the block (ties, within ``tol``, go to the
  lowest index), its direction projected out before the next pick;
- rotation: the orthogonal U maximising trace(C[pivots] U) (the polar factor), so each orbital is the one most like
  its pivot: pure p_x and p_y for a linear molecule, as a chemist would draw them.
Both steps depend on the block's span only, not on the basis LAPACK returned. Then every orbital's sign is set so
its largest coefficient (the first within ``tol``) is positive.
"""

from __future__ import annotations

import numpy as np


def degenerate_blocks(mo_energy: np.ndarray, mo_occ: np.ndarray, tol: float) -> list[np.ndarray]:
    """Index arrays of runs of consecutive orbitals (energy order) with equal occupation and energies within ``tol``."""
    blocks, start = [], 0
    for i in range(1, len(mo_energy) + 1):
        if i == len(mo_energy) or abs(mo_energy[i] - mo_energy[i - 1]) > tol or mo_occ[i] != mo_occ[i - 1]:
            if i - start > 1:
                blocks.append(np.arange(start, i))
            start = i
    return blocks


def pivot_rows(block: np.ndarray, tol: float) -> list[int]:
    """One AO row per column of ``block`` [n_ao, k], chosen by largest remaining weight (ties to the lowest index)."""
    residual = block.copy()
    pivots: list[int] = []
    for _ in range(block.shape[1]):
        norms = np.linalg.norm(residual, axis=1)
        row = int(np.flatnonzero(norms >= norms.max() - tol)[0])
        pivots.append(row)
        q = residual[row] / norms[row]
        residual = residual - np.outer(residual @ q, q)
    return pivots


def fix_signs(mo_coeff: np.ndarray, tol: float) -> np.ndarray:
    """Each column's first coefficient within ``tol`` of its largest magnitude made positive."""
    out = mo_coeff.copy()
    for j in range(out.shape[1]):
        mags = np.abs(out[:, j])
        row = int(np.flatnonzero(mags >= mags.max() - tol)[0])
        if out[row, j] < 0:
            out[:, j] = -out[:, j]
    return out


def canonical_orbitals(mo_coeff: np.ndarray, mo_energy: np.ndarray, mo_occ: np.ndarray,
                       tol: float = 1e-6) -> np.ndarray:
    """``mo_coeff`` with every degenerate block rotated and every sign set by the rule of the module docstring."""
    out = np.array(mo_coeff, dtype=np.float64, copy=True)
    for idx in degenerate_blocks(np.asarray(mo_energy), np.asarray(mo_occ), tol):
        block = out[:, idx]
        w, _, vt = np.linalg.svd(block[pivot_rows(block, tol)])
        out[:, idx] = block @ (vt.T @ w.T)
    return fix_signs(out, tol)

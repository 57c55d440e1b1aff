"""The CCSD state exp(T1 + T2)|HF> written out on PySCF's determinant vector, for the supervised warm start.

Why: CISD knows singles and doubles only, and its variational energy is poor where it matters (N2 STO-3G: 18.3 mHa
above FCI, C2: 53.7). The CCSD wavefunction has the same cost to get from PySCF but also the disconnected triples
and quadruples (T1 T2, T2^2 / 2, ...), with their signs: as a state it lies 3.0 mHa above FCI on N2 and 12.9 on C2.

The exponential is summed as a Taylor series of the excitation operator T applied to a vector. Spin-adapted
RCCSD: T1 = sum t1[i,a] E_ai and T2 = 1/2 sum t2[i,j,a,b] E_ai E_bj, with E_pq = sum_sigma a+_p,sigma a_q,sigma.
T only excites, so the series ends after at most n_electrons / 2 + 1 terms.
"""

from __future__ import annotations

import warnings

import numpy as np

from seqlab.nnqs.hamiltonian import mo_integrals

MAX_TERMS = 64  # T is nilpotent on a finite space; this only guards against a bug looping forever
DENOMINATOR_FLOOR = 1e-2  # Hartree: the smallest H_DD - E a perturbative step divides by


def _excite(amplitudes: np.ndarray, vec: np.ndarray, n_orb: int, nelec: tuple[int, int]) -> np.ndarray:
    """sum_{a,i} amplitudes[i, a] E_{a i} |vec> (occupied i, virtual a) through PySCF's non-Hermitian 1-e kernel."""
    from pyscf.fci import direct_nosym  # optional heavy dependency (the nnqs extra)

    n_occ = amplitudes.shape[0]
    op = np.zeros((n_orb, n_orb))
    op[n_occ:, :n_occ] = amplitudes.T
    return direct_nosym.contract_1e(op, vec, n_orb, nelec)


def _apply_t(t1: np.ndarray, t2: np.ndarray, vec: np.ndarray, n_orb: int, nelec: tuple[int, int]) -> np.ndarray:
    """(T1 + T2)|vec>. T2 is one call of PySCF's general two-body kernel, which applies sum_pqrs g[p,q,r,s] E_pq E_rs:
    with g[a,i,b,j] = t2[i,j,a,b] / 2 that is T2 exactly (E_ai E_bj needs no reordering, since i != b). Applying
    E_bj then E_ai one pair (j, b) at a time took 2 n_occ n_vir passes over the vector, 3x slower on N2."""
    from pyscf.fci import direct_nosym  # optional heavy dependency (the nnqs extra)

    n_occ = t1.shape[0]
    g = np.zeros((n_orb,) * 4)
    g[n_occ:, :n_occ, n_occ:, :n_occ] = 0.5 * t2.transpose(2, 0, 3, 1)
    return _excite(t1, vec, n_orb, nelec) + direct_nosym.contract_2e(g, vec, n_orb, nelec)


def ccsd_fcivec(mf, n_orb: int, nelec: tuple[int, int]) -> tuple[np.ndarray, float] | None:
    """(exp(T)|HF> as a [n_alpha_strings, n_beta_strings] array, E_CCSD) for a closed-shell RHF ``mf``; None
    (with a warning) where CCSD does not converge, as in strongly stretched bonds."""
    from pyscf import cc as pyscf_cc  # optional heavy dependency (the nnqs extra)
    from pyscf.fci import cistring

    solver = pyscf_cc.CCSD(mf)
    solver.verbose = 0
    solver.kernel()
    if not solver.converged:
        warnings.warn("warm start: CCSD did not converge; fitting the lower in energy of CISD and CASCI instead",
                      stacklevel=3)
        return None
    hf = np.zeros((cistring.num_strings(n_orb, nelec[0]), cistring.num_strings(n_orb, nelec[1])))
    hf[0, 0] = 1.0  # PySCF's first string in each spin fills the lowest orbitals
    total, term = hf.copy(), hf
    for k in range(1, MAX_TERMS):
        term = _apply_t(solver.t1, solver.t2, term, n_orb, nelec) / k
        total += term
        if np.abs(term).max() < 1e-14:
            break
    return total, float(solver.e_tot)


def _sector_hamiltonian(mf, n_orb: int, nelec: tuple[int, int]):
    """(v -> H v without E_nuc on PySCF's determinant vector, the diagonal H_DD without E_nuc, E_nuc)."""
    from pyscf.fci import direct_spin1  # optional heavy dependency (the nnqs extra)

    h1, eri, e_nuc = mo_integrals(mf)
    h2 = direct_spin1.absorb_h1e(h1, eri, n_orb, nelec, 0.5)

    def apply(vec: np.ndarray) -> np.ndarray:
        return direct_spin1.contract_2e(h2, vec, n_orb, nelec).reshape(vec.shape)

    return apply, lambda: direct_spin1.make_hdiag(h1, eri, n_orb, nelec), e_nuc


def state_energy(mf, vec: np.ndarray, n_orb: int, nelec: tuple[int, int]) -> float:
    """<v|H|v> / <v|v> of a state on PySCF's determinant vector, in ``mf``'s orbitals (one H application)."""
    apply_h, _, e_nuc = _sector_hamiltonian(mf, n_orb, nelec)
    return float(np.vdot(vec, apply_h(vec)) / np.vdot(vec, vec)) + e_nuc


def perturbed_state(mf, vec: np.ndarray, n_orb: int, nelec: tuple[int, int]) -> tuple[np.ndarray, float, float]:
    """One Epstein-Nesbet step from ``vec``: c_D -= r_D / (H_DD - E) on every determinant D, where r = H c - E c is
    the residual and E = <c|H|c> (the first correction vector of Davidson's method, added with weight 1).

    Why: CCSD's state has no connected triples, and where its disconnected ones (T1 T2) carry the wrong sign, as in
    C2 (4.2e-3 of FCI's weight on configurations whose CCSD sign is wrong), VMC starts from that sign structure and
    ends on a plateau that keeps some of it (docs/nnqs.md, "Where the plateaus' error lives"). The residual holds the
    connected triples' first-order amplitudes. Costs one H application on the FCI-sized vector, less than one
    exact-sum VMC step. Returns (the corrected vector normalised, <c|H|c> before, <c|H|c> after), with ``mf``'s
    nuclear repulsion included in both energies.
    """
    apply_h, diagonal, e_nuc = _sector_hamiltonian(mf, n_orb, nelec)
    c = vec / np.linalg.norm(vec)
    hc = apply_h(c)
    energy = float(np.vdot(c, hc))
    gap = diagonal().reshape(c.shape) - energy
    # E lies below every diagonal element wherever c is a correlated state (measured: 0.18 Ha or more on N2 and C2),
    # so the floor only keeps a degenerate case finite
    corrected = c - (hc - energy * c) / np.maximum(gap, DENOMINATOR_FLOOR)
    corrected /= np.linalg.norm(corrected)
    after = float(np.vdot(corrected, apply_h(corrected)))
    return corrected, energy + e_nuc, after + e_nuc

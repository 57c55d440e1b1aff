"""PySCF on the user's molecule: mean field, MO integrals -> Hamiltonian, and the reference energies.

References come from PySCF on the *same* molecular orbitals the Hamiltonian is built from: HF, CCSD, CCSD(T) and FCI.
FCI asks for several roots because Davidson can land on an excited state (C2 is the classic case) and because the
determinant space with fixed (N_alpha, N_beta) also holds higher-spin states; the reference is the lowest root whose
<S^2> matches the requested spin.

pyscf is imported inside the functions that need it: it is an optional heavy dependency (the nnqs extra).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np

from seqlab.nnqs.hamiltonian import Hamiltonian, mo_integrals
from seqlab.nnqs.molecules import Molecule, MoleculeError
from seqlab.nnqs.orbitals import canonical_orbitals
from seqlab.nnqs.space import check_size


def build_pyscf(mol: Molecule):
    """pyscf.gto.Mole for ``mol``; the number of orbitals is checked against N_alpha and seqlab's limit here."""
    from pyscf import gto  # optional heavy dependency (see the module docstring)

    with warnings.catch_warnings(record=True) as said:  # shown only if the molecule builds: on an unknown basis
        warnings.simplefilter("always")                 # PySCF first suggests a package, then fails anyway
        try:
            pmol = gto.M(atom=mol.atom_string(), basis=mol.basis, charge=mol.charge, spin=mol.spin,
                         unit=mol.unit, verbose=0)
        except (RuntimeError, KeyError, ValueError) as e:  # PySCF reports unknown basis sets etc. this way
            raise MoleculeError(f"PySCF rejected {mol.name} (basis {mol.basis!r}): {e}") from e
    for w in said:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if mol.n_alpha > pmol.nao:
        raise MoleculeError(
            f"{mol.name}: {mol.n_alpha} alpha electrons do not fit into {pmol.nao} orbitals of basis {mol.basis!r}"
        )
    try:  # before the SCF, which for a basis this large could take minutes
        check_size(pmol.nao)
    except ValueError as e:
        raise MoleculeError(f"{mol.name} in basis {mol.basis!r}: {e}") from None
    return pmol


def run_scf(pmol, conv_tol: float = 1e-10):
    """RHF for closed shells, ROHF otherwise (one set of orbitals for both spins, as the pair tokens assume), with
    degenerate orbitals and signs fixed by ``orbitals.canonical_orbitals`` so every process gets the same ones."""
    from pyscf import scf  # optional heavy dependency (see the module docstring)

    mf = scf.RHF(pmol) if pmol.spin == 0 else scf.ROHF(pmol)
    mf.conv_tol = conv_tol
    mf.kernel()
    if not mf.converged:  # second-order solver rescues the usual stragglers
        mf = mf.newton()
        mf.kernel()
    if not mf.converged:
        warnings.warn(f"SCF did not converge for {pmol.atom}; energies are relative to unconverged orbitals")
    mf.mo_coeff = canonical_orbitals(mf.mo_coeff, mf.mo_energy, mf.mo_occ)
    return mf


@dataclass
class References:
    e_hf: float | None = None
    e_ccsd: float | None = None
    e_ccsd_t: float | None = None
    e_fci: float | None = None
    e_fci_sector: float | None = None  # lowest eigenvalue with these N_alpha, N_beta (any total spin)
    fci_roots: list[float] = field(default_factory=list)
    fci_s2: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


FCI_MAX_DETERMINANTS = 5_000_000


def reference_energies(mf, h1: np.ndarray, eri: np.ndarray, e_nuc: float, nelec: tuple[int, int],
                       fci: bool = True, cc: bool = True, n_roots: int = 4) -> References:
    """HF, CCSD, CCSD(T) and FCI (the lowest root; the lowest of the right spin among ``n_roots`` when it is not
    of the right spin) for the given integrals."""
    from pyscf import cc as pcc  # optional heavy dependency (see the module docstring)
    from pyscf import fci as pfci

    ref = References(e_hf=float(mf.e_tot))
    norb = h1.shape[0]
    if cc:  # CC failing must not stop the NNQS run; the table shows null, the note names the method that failed
        mycc = None
        try:
            mycc = pcc.CCSD(mf)
            mycc.verbose = 0
            mycc.conv_tol, mycc.conv_tol_normt = 1e-10, 1e-8  # PySCF's defaults leave ~1e-7 Ha: CCSD "below" FCI
            mycc.kernel()
            ref.e_ccsd = float(mycc.e_tot)
            if not mycc.converged:
                ref.notes.append("CCSD did not converge")
        except Exception as e:
            ref.notes.append(f"CCSD failed: {e}")
        if ref.e_ccsd is not None and sum(nelec) <= 2:  # no triples with two electrons
            ref.e_ccsd_t = ref.e_ccsd
        elif ref.e_ccsd is not None:
            try:  # PySCF's (T) on an open shell (H2-: one virtual beta orbital) can fail where CCSD did not
                ref.e_ccsd_t = float(mycc.e_tot + mycc.ccsd_t())
            except Exception as e:
                ref.notes.append(f"CCSD(T) failed: {e}")
    dim = math.comb(norb, nelec[0]) * math.comb(norb, nelec[1])
    if fci and dim <= FCI_MAX_DETERMINANTS:
        solver = pfci.direct_spin1.FCI()
        solver.conv_tol = 1e-12
        solver.max_cycle = 500
        solver.verbose = 0
        s = abs(nelec[0] - nelec[1]) / 2
        # the lowest root alone first: when its spin is right it is both e_fci and e_fci_sector, and each extra root
        # multiplies the cost (H2O/6-31G, 1.7 M determinants: minutes per root); more roots only when it is not
        for nroots in dict.fromkeys((1, min(n_roots, dim))):
            e, ci = solver.kernel(h1, eri, norb, nelec, ecore=e_nuc, nroots=nroots)
            e, ci = (np.atleast_1d(e), ci if nroots > 1 else [ci])
            ss = [float(pfci.spin_op.spin_square0(c, norb, nelec)[0]) for c in ci]
            if abs(ss[0] - s * (s + 1)) < 1e-3:
                break
        ref.fci_roots, ref.fci_s2 = [float(v) for v in e], ss
        ref.e_fci_sector = float(min(e))
        good = [float(ei) for ei, si in zip(e, ss) if abs(si - s * (s + 1)) < 1e-3]
        if good:
            ref.e_fci = min(good)
        else:
            ref.notes.append(f"no FCI root among {nroots} has S={s}; e_fci is null")
        if ref.e_fci is not None and ref.e_fci_sector < ref.e_fci - 1e-8:
            ref.notes.append(
                f"a state of different total spin lies below the S={s} ground state "
                f"({ref.e_fci_sector:.8f} < {ref.e_fci:.8f}); NNQS (fixed N_alpha, N_beta) can go below e_fci"
            )
    elif fci:
        ref.notes.append(f"FCI skipped: {dim} determinants > {FCI_MAX_DETERMINANTS}")
    return ref


@dataclass
class System:
    """Everything the NNQS run needs about one molecule: the input, the Hamiltonian and the references."""

    molecule: Molecule
    hamiltonian: Hamiltonian
    references: References
    mf: object = None

    @property
    def n_orb(self) -> int:
        return self.hamiltonian.n_orb


def prepare(mol: Molecule, fci: bool = True, cc: bool = True, n_roots: int = 4, pmol=None) -> System:
    """SCF -> MO integrals -> Hamiltonian, plus reference energies on the same orbitals (``pmol``: the PySCF molecule
    when the caller already built it with ``build_pyscf``)."""
    mf = run_scf(pmol if pmol is not None else build_pyscf(mol))
    h1, eri, e_nuc = mo_integrals(mf)
    ham = Hamiltonian(h1, eri, e_nuc, mol.n_alpha, mol.n_beta)
    refs = reference_energies(mf, h1, eri, e_nuc, (mol.n_alpha, mol.n_beta), fci=fci, cc=cc, n_roots=n_roots)
    return System(mol, ham, refs, mf)

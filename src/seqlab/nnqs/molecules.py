"""Molecules: built-in geometries, ``--atom`` parsing, PySCF mean field and the reference energies.

Built-in geometries are those of Choo et al., "Fermionic neural-network states for ab-initio electronic
structure" (Nat. Commun. 2020), in Angstrom, STO-3G, so NNQS numbers can be compared with the literature.

References come from PySCF on the *same* molecular orbitals the Hamiltonian is built from: HF, CCSD, CCSD(T) and FCI.
FCI asks for several roots because Davidson can land on an excited state (C2 is the classic case) and because the
determinant space with fixed (N_alpha, N_beta) also holds higher-spin states; the reference is the lowest root whose
<S^2> matches the requested spin.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np

# name -> (atom string in Angstrom, charge, 2S)
BUILTIN: dict[str, tuple[str, int, int]] = {
    "h2": ("H 0 0 0; H 0 0 0.734", 0, 0),
    "lih": ("Li 0 0 0; H 0 0 1.548", 0, 0),
    "h2o": ("O 0 0 0.137; H 0 0.769 -0.546; H 0 -0.769 -0.546", 0, 0),
    "nh3": ("N 0 0 0.149; H 0 0.947 -0.348; H 0.821 -0.474 -0.348; H -0.821 -0.474 -0.348", 0, 0),
    "n2": ("N 0 0 0; N 0 0 1.19", 0, 0),
    "c2": ("C 0 0 0; C 0 0 1.26", 0, 0),
}

_ELEMENTS = (
    "H He Li Be B C N O F Ne Na Mg Al Si P S Cl Ar K Ca Sc Ti V Cr Mn Fe Co Ni Cu Zn Ga Ge As Se Br Kr".split()
)
Z_OF = {sym: z for z, sym in enumerate(_ELEMENTS, start=1)}
MIN_DISTANCE = 0.1  # Angstrom; closer nuclei are a typo, not a molecule


class MoleculeError(ValueError):
    """Bad molecule input (unknown name, malformed geometry, impossible charge/spin)."""


@dataclass
class Molecule:
    """A molecule as the user asked for it (before any PySCF object exists)."""

    name: str
    atoms: list[tuple[str, tuple[float, float, float]]]
    basis: str = "sto-3g"
    charge: int = 0
    spin: int = 0  # 2S = N_alpha - N_beta, PySCF's convention

    @property
    def n_electrons(self) -> int:
        return sum(Z_OF[sym] for sym, _ in self.atoms) - self.charge

    @property
    def n_alpha(self) -> int:
        return (self.n_electrons + self.spin) // 2

    @property
    def n_beta(self) -> int:
        return (self.n_electrons - self.spin) // 2

    def atom_string(self) -> str:
        return "; ".join(f"{s} {x:.10g} {y:.10g} {z:.10g}" for s, (x, y, z) in self.atoms)


def parse_atoms(text: str, source: str = "--atom") -> list[tuple[str, tuple[float, float, float]]]:
    """Parse ``"El x y z; El x y z"`` (``;`` or newlines between atoms, Angstrom) with errors naming the atom."""
    if not text or not text.strip():
        raise MoleculeError(f"{source}: empty geometry; expected e.g. \"H 0 0 0; H 0 0 0.74\"")
    atoms = []
    entries = [e.strip() for e in text.replace("\n", ";").split(";")]
    for n, entry in enumerate((e for e in entries if e), start=1):
        fields = entry.replace(",", " ").split()
        if len(fields) != 4:
            raise MoleculeError(f"{source}: atom {n} {entry!r} must be 'Element x y z' (4 fields, got {len(fields)})")
        sym = fields[0].capitalize()
        if sym not in Z_OF:
            raise MoleculeError(f"{source}: atom {n} {entry!r}: unknown element {fields[0]!r} (known: H..Kr)")
        try:
            xyz = tuple(float(v) for v in fields[1:])
        except ValueError:
            raise MoleculeError(f"{source}: atom {n} {entry!r}: coordinates must be numbers") from None
        if not all(math.isfinite(v) for v in xyz):
            raise MoleculeError(f"{source}: atom {n} {entry!r}: coordinates must be finite")
        atoms.append((sym, xyz))
    if not atoms:
        raise MoleculeError(f"{source}: no atoms found in {text!r}")
    pos = np.array([xyz for _, xyz in atoms])
    for i in range(len(atoms)):
        for j in range(i):
            d = float(np.linalg.norm(pos[i] - pos[j]))
            if d < MIN_DISTANCE:
                raise MoleculeError(
                    f"{source}: atoms {j + 1} ({atoms[j][0]}) and {i + 1} ({atoms[i][0]}) are {d:.3g} A apart "
                    f"(< {MIN_DISTANCE} A); coordinates are in Angstrom"
                )
    return atoms


def get_molecule(name: str | None = None, atom: str | None = None, basis: str = "sto-3g",
                 charge: int | None = None, spin: int | None = None) -> Molecule:
    """A built-in molecule by name, or one given as an ``--atom`` string; validates charge and spin."""
    if (name is None) == (atom is None):
        raise MoleculeError("give exactly one of --molecule NAME or --atom \"El x y z; ...\"")
    if name is not None:
        key = name.lower()
        if key not in BUILTIN:
            raise MoleculeError(f"unknown molecule {name!r}; known molecules: {', '.join(BUILTIN)}")
        geom, c0, s0 = BUILTIN[key]
        mol = Molecule(key, parse_atoms(geom, f"built-in {key}"), basis, c0 if charge is None else charge,
                       s0 if spin is None else spin)
    else:
        atoms = parse_atoms(atom)
        mol = Molecule(_formula(atoms), atoms, basis, charge or 0, spin or 0)
    check_charge_spin(mol)
    return mol


def _formula(atoms) -> str:
    counts: dict[str, int] = {}
    for s, _ in atoms:
        counts[s] = counts.get(s, 0) + 1
    return "".join(f"{s}{n if n > 1 else ''}" for s, n in counts.items())


def check_charge_spin(mol: Molecule) -> None:
    n = mol.n_electrons
    if n <= 0:
        raise MoleculeError(f"--charge {mol.charge} leaves {n} electrons on {mol.name}; nothing to solve")
    if mol.spin < 0:
        raise MoleculeError(f"--spin {mol.spin}: spin is 2S = N_alpha - N_beta and must be >= 0")
    if (n + mol.spin) % 2:
        raise MoleculeError(
            f"--charge {mol.charge} --spin {mol.spin}: {mol.name} has {n} electrons, so 2S must be "
            f"{'odd' if n % 2 else 'even'} (spin={mol.spin} is {'odd' if mol.spin % 2 else 'even'})"
        )
    if mol.spin > n:
        raise MoleculeError(f"--spin {mol.spin} exceeds the number of electrons ({n}) of {mol.name}")


def build_pyscf(mol: Molecule):
    """pyscf.gto.Mole for ``mol``; the number of orbitals is checked against N_alpha here."""
    from pyscf import gto

    try:
        pmol = gto.M(atom=mol.atom_string(), basis=mol.basis, charge=mol.charge, spin=mol.spin,
                     unit="Angstrom", verbose=0)
    except (RuntimeError, KeyError, ValueError) as e:  # PySCF reports unknown basis sets etc. this way
        raise MoleculeError(f"PySCF rejected {mol.name} (basis {mol.basis!r}): {e}") from e
    if mol.n_alpha > pmol.nao:
        raise MoleculeError(
            f"{mol.name}: {mol.n_alpha} alpha electrons do not fit into {pmol.nao} orbitals of basis {mol.basis!r}"
        )
    return pmol


def run_scf(pmol, conv_tol: float = 1e-10):
    """RHF for closed shells, ROHF otherwise (one set of orbitals for both spins, as the pair tokens assume)."""
    from pyscf import scf

    mf = scf.RHF(pmol) if pmol.spin == 0 else scf.ROHF(pmol)
    mf.conv_tol = conv_tol
    mf.kernel()
    if not mf.converged:  # second-order solver rescues the usual stragglers
        mf = mf.newton()
        mf.kernel()
    if not mf.converged:
        warnings.warn(f"SCF did not converge for {pmol.atom}; energies are relative to unconverged orbitals")
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
    """HF, CCSD, CCSD(T) and FCI (lowest root of the right spin among ``n_roots``) for the given integrals."""
    from pyscf import cc as pcc
    from pyscf import fci as pfci

    ref = References(e_hf=float(mf.e_tot))
    norb = h1.shape[0]
    if cc:
        try:
            mycc = pcc.CCSD(mf)
            mycc.verbose = 0
            mycc.kernel()
            ref.e_ccsd = float(mycc.e_tot)
            if not mycc.converged:
                ref.notes.append("CCSD did not converge")
            ref.e_ccsd_t = float(mycc.e_tot + mycc.ccsd_t()) if sum(nelec) > 2 else ref.e_ccsd
        except Exception as e:  # CC failing must not stop the NNQS run; the table shows null
            ref.notes.append(f"CCSD failed: {e}")
    dim = math.comb(norb, nelec[0]) * math.comb(norb, nelec[1])
    if fci and dim <= FCI_MAX_DETERMINANTS:
        solver = pfci.direct_spin1.FCI()
        solver.conv_tol = 1e-12
        solver.max_cycle = 500
        solver.verbose = 0
        nroots = min(n_roots, dim)
        e, ci = solver.kernel(h1, eri, norb, nelec, ecore=e_nuc, nroots=nroots)
        e, ci = (np.atleast_1d(e), ci if nroots > 1 else [ci])
        s = abs(nelec[0] - nelec[1]) / 2
        ss = [float(pfci.spin_op.spin_square0(c, norb, nelec)[0]) for c in ci]
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
    hamiltonian: "Hamiltonian"  # noqa: F821
    references: References
    mf: object = None

    @property
    def n_orb(self) -> int:
        return self.hamiltonian.n_orb


def prepare(mol: Molecule, fci: bool = True, cc: bool = True, n_roots: int = 4) -> System:
    """SCF -> MO integrals -> Hamiltonian, plus reference energies on the same orbitals."""
    from seqlab.nnqs.hamiltonian import Hamiltonian, mo_integrals

    mf = run_scf(build_pyscf(mol))
    h1, eri, e_nuc = mo_integrals(mf)
    ham = Hamiltonian(h1, eri, e_nuc, mol.n_alpha, mol.n_beta)
    refs = reference_energies(mf, h1, eri, e_nuc, (mol.n_alpha, mol.n_beta), fci=fci, cc=cc, n_roots=n_roots)
    return System(mol, ham, refs, mf)

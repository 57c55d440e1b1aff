"""Molecules as the user gives them: built-in geometries, ``--atom`` strings and ``.xyz`` files, in Angstrom or Bohr.

Built-in geometries are those of Choo et al., "Fermionic neural-network states for ab-initio electronic
structure" (Nat. Commun. 2020), in Angstrom, STO-3G, so NNQS numbers can be compared with the literature.
Nothing here touches PySCF: every input error is found (and named by flag, file and line) before any SCF runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# name -> (atom string in Angstrom, charge, 2S)
BUILTIN: dict[str, tuple[str, int, int]] = {
    "h2": ("H 0 0 0; H 0 0 0.734", 0, 0),
    "lih": ("Li 0 0 0; H 0 0 1.548", 0, 0),
    "h2o": ("O 0 0 0.137; H 0 0.769 -0.546; H 0 -0.769 -0.546", 0, 0),
    "nh3": ("N 0 0 0.149; H 0 0.947 -0.348; H 0.821 -0.474 -0.348; H -0.821 -0.474 -0.348", 0, 0),
    "n2": ("N 0 0 0; N 0 0 1.19", 0, 0),
    # C2, STO-3G: 1.26 A as in the source above (the experimental r_e of the X 1Sigma_g+ state is 1.2425 A, Huber &
    # Herzberg 1979); 12 electrons in 10 orbitals, 44 100 determinants, strongly multi-reference (HF weight 0.67)
    "c2": ("C 0 0 0; C 0 0 1.26", 0, 0),
}

_ELEMENTS = (
    "H He Li Be B C N O F Ne Na Mg Al Si P S Cl Ar K Ca Sc Ti V Cr Mn Fe Co Ni Cu Zn Ga Ge As Se Br Kr".split()
)
Z_OF = {sym: z for z, sym in enumerate(_ELEMENTS, start=1)}
UNITS = ("angstrom", "bohr")
BOHR_IN_ANGSTROM = 0.52917721092  # PySCF's value (pyscf.data.nist.BOHR)
MIN_DISTANCE = 0.1  # Angstrom; closer nuclei are a typo (or the wrong unit), not a molecule
_UNIT_ABBREV = {"angstrom": "A", "bohr": "bohr"}

Atom = tuple[str, tuple[float, float, float]]


class MoleculeError(ValueError):
    """Bad molecule input (unknown name, malformed geometry, impossible charge/spin)."""


@dataclass
class Molecule:
    """A molecule as the user asked for it (before any PySCF object exists); coordinates are in ``unit``."""

    name: str
    atoms: list[Atom]
    basis: str = "sto-3g"
    charge: int = 0
    spin: int = 0  # 2S = N_alpha - N_beta, PySCF's convention
    unit: str = "angstrom"

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


def check_unit(unit: str) -> str:
    key = unit.lower()
    if key not in UNITS:
        raise MoleculeError(f"--unit {unit!r}: expected one of {', '.join(UNITS)}")
    return key


def parse_atom(entry: str, where: str) -> Atom:
    """One ``El x y z`` entry (commas allowed between fields; the element by symbol or atomic number)."""
    fields = entry.replace(",", " ").split()
    if len(fields) != 4:
        raise MoleculeError(f"{where} must be 'Element x y z' (4 fields, got {len(fields)})")
    sym = fields[0].capitalize()
    if sym.isdigit() and 1 <= int(sym) <= len(_ELEMENTS):
        sym = _ELEMENTS[int(sym) - 1]
    if sym not in Z_OF:
        raise MoleculeError(f"{where}: unknown element {fields[0]!r} (known: H..Kr)")
    try:
        xyz = tuple(float(v) for v in fields[1:])
    except ValueError:
        raise MoleculeError(f"{where}: coordinates must be numbers") from None
    if not all(math.isfinite(v) for v in xyz):
        raise MoleculeError(f"{where}: coordinates must be finite")
    return sym, xyz


def check_distances(atoms: list[Atom], source: str, unit: str = "angstrom") -> None:
    """Refuse nuclei closer than ``MIN_DISTANCE`` (a typo, or Bohr coordinates read as Angstrom's neighbour)."""
    pos = np.array([xyz for _, xyz in atoms])
    limit = MIN_DISTANCE if unit == "angstrom" else MIN_DISTANCE / BOHR_IN_ANGSTROM
    abbrev = _UNIT_ABBREV[unit]
    for i in range(len(atoms)):
        for j in range(i):
            d = float(np.linalg.norm(pos[i] - pos[j]))
            if d < limit:
                raise MoleculeError(
                    f"{source}: atoms {j + 1} ({atoms[j][0]}) and {i + 1} ({atoms[i][0]}) are {d:.3g} {abbrev} "
                    f"apart (< {limit:.3g} {abbrev}); coordinates are in {unit.capitalize()}"
                )


def parse_atoms(text: str, source: str = "--atom", unit: str = "angstrom") -> list[Atom]:
    """Parse ``"El x y z; El x y z"`` (``;`` or newlines between atoms) with errors naming the atom."""
    if not text or not text.strip():
        raise MoleculeError(f"{source}: empty geometry; expected e.g. \"H 0 0 0; H 0 0 0.74\"")
    entries = [e.strip() for e in text.replace("\n", ";").split(";")]
    atoms = [parse_atom(entry, f"{source}: atom {n} {entry!r}")
             for n, entry in enumerate((e for e in entries if e), start=1)]
    if not atoms:
        raise MoleculeError(f"{source}: no atoms found in {text!r}")
    check_distances(atoms, source, unit)
    return atoms


def read_xyz(path: str | Path, unit: str = "angstrom") -> list[Atom]:
    """A standard single-geometry ``.xyz`` file: the atom count, a comment line, then one ``El x y z`` per atom.

    Errors name the file and the line (``FILE:LINE: ...``), the way compilers do, so an editor can jump to it.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # (an editor's BOM is no atom count)
    except UnicodeDecodeError:
        raise MoleculeError(f"{path}: not a text file (expected .xyz)") from None
    except OSError as e:
        raise MoleculeError(f"--xyz {path}: cannot read it ({e.strerror or e})") from None
    if not lines or not lines[0].strip():
        raise MoleculeError(f"{path}:1: expected the number of atoms on the first line, got an empty line")
    try:
        count = int(lines[0].strip())
    except ValueError:
        raise MoleculeError(f"{path}:1: expected the number of atoms on the first line, got {lines[0].strip()!r}") \
            from None
    if count < 1:
        raise MoleculeError(f"{path}:1: the number of atoms must be >= 1, got {count}")
    if len(lines) < 2:
        raise MoleculeError(f"{path}:2: missing the comment line (the second line of an .xyz file)")
    atoms = []
    for n in range(3, 3 + count):
        if n > len(lines):
            raise MoleculeError(f"{path}:{n}: file ends after {len(atoms)} atoms, but line 1 says {count}")
        atoms.append(parse_atom(lines[n - 1].strip(), f"{path}:{n}: {lines[n - 1].strip()!r}"))
    for n in range(3 + count, len(lines) + 1):
        if lines[n - 1].strip():
            raise MoleculeError(f"{path}:{n}: more atom lines than the {count} announced on line 1 "
                                f"(one geometry per file)")
    check_distances(atoms, str(path), unit)
    return atoms


def get_molecule(name: str | None = None, atom: str | None = None, basis: str = "sto-3g",
                 charge: int | None = None, spin: int | None = None, xyz: str | Path | None = None,
                 unit: str | None = None) -> Molecule:
    """A built-in molecule by name, an ``--atom`` string or an ``.xyz`` file; validates unit, charge and spin."""
    if sum(v is not None for v in (name, atom, xyz)) != 1:
        raise MoleculeError("give exactly one of --molecule NAME, --atom \"El x y z; ...\" or --xyz FILE")
    unit_key = check_unit(unit or "angstrom")
    if name is not None:
        if unit_key != "angstrom":
            raise MoleculeError(f"--unit {unit} applies to --atom and --xyz; built-in molecules are in Angstrom")
        key = name.lower()
        if key not in BUILTIN:
            raise MoleculeError(f"unknown molecule {name!r}; known molecules: {', '.join(BUILTIN)}")
        geom, c0, s0 = BUILTIN[key]
        mol = Molecule(key, parse_atoms(geom, f"built-in {key}"), basis, c0 if charge is None else charge,
                       s0 if spin is None else spin)
    else:
        atoms = parse_atoms(atom, unit=unit_key) if atom is not None else read_xyz(xyz, unit_key)
        mol = Molecule(_formula(atoms), atoms, basis, charge or 0, spin or 0, unit_key)
    check_charge_spin(mol)
    return mol


def _formula(atoms: list[Atom]) -> str:
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

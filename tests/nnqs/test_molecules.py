"""Molecule input: built-in names, --atom parsing and charge/spin validation, with errors that say what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

from seqlab.cli import main
from seqlab.nnqs import references
from seqlab.nnqs.molecules import BOHR_IN_ANGSTROM, BUILTIN, MoleculeError, get_molecule, parse_atoms, read_xyz
from seqlab.nnqs.references import prepare
from seqlab.nnqs.space import all_configurations, tokens_to_keys

WATER_XYZ = """3
water, Choo et al. geometry (Angstrom)
O 0 0 0.137
H 0 0.769 -0.546
  h   0.0  -0.769  -0.546

"""


def test_builtin_geometries_and_electron_counts():
    counts = {"h2": 2, "lih": 4, "h2o": 10, "nh3": 10, "n2": 14, "c2": 12}
    assert set(BUILTIN) == set(counts)
    for name, n in counts.items():
        m = get_molecule(name)
        assert m.n_electrons == n and m.n_alpha == m.n_beta == n // 2
    h2o = get_molecule("H2O")  # case-insensitive
    assert [s for s, _ in h2o.atoms] == ["O", "H", "H"]
    assert np.allclose(h2o.atoms[1][1], (0, 0.769, -0.546))


def test_unknown_molecule_lists_known_ones():
    with pytest.raises(MoleculeError, match="known molecules: h2, lih, h2o, nh3, n2, c2"):
        get_molecule("benzene")


@pytest.mark.parametrize(
    "text,match",
    [
        ("H 0 0; H 0 0 0.74", r"atom 1 'H 0 0' must be 'Element x y z' \(4 fields, got 3\)"),
        ("H 0 0 0; Xx 0 0 1", r"atom 2 .*unknown element 'Xx'"),
        ("H 0 0 0; H 0 0 abc", r"atom 2 .*coordinates must be numbers"),
        ("H 0 0 0; H 0 0 0.01", r"atoms 1 \(H\) and 2 \(H\) are 0.01 A apart"),
        ("  ;  ", r"no atoms found"),
        ("", r"empty geometry"),
    ],
)
def test_bad_geometry_strings(text, match):
    with pytest.raises(MoleculeError, match=match):
        parse_atoms(text)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(name="h2", spin=1), r"2S must be even"),
        (dict(name="h2", charge=2), r"leaves 0 electrons"),
        (dict(atom="H 0 0 0", spin=0), r"2S must be odd"),
        (dict(name="h2", spin=4), r"exceeds the number of electrons"),
        (dict(name="h2", spin=-2), r"must be >= 0"),
        (dict(name="h2", atom="H 0 0 0"), r"exactly one of"),
    ],
)
def test_impossible_charge_spin(kw, match):
    with pytest.raises(MoleculeError, match=match):
        get_molecule(**kw)


def test_open_shell_atom_string_uses_rohf_and_right_spin_fci():
    """H3 chain, doublet: ROHF orbitals; the FCI reference is the lowest S=1/2 root; ED agrees."""
    m = get_molecule(atom="H 0 0 0\nH 0 0 0.9\nH 0 0 1.8", spin=1)
    assert m.name == "H3" and (m.n_alpha, m.n_beta) == (2, 1)
    s = prepare(m, cc=False)
    assert type(s.mf).__name__.startswith("ROHF")
    ham = s.hamiltonian
    w = np.linalg.eigvalsh(ham.dense(tokens_to_keys(all_configurations(ham.n_orb, 2, 1))))
    assert abs(w[0] - s.references.e_fci) < 1e-8
    assert abs(s.references.fci_s2[0] - 0.75) < 1e-6


def test_xyz_file_gives_the_built_in_molecule(tmp_path):
    (tmp_path / "water.xyz").write_text(WATER_XYZ)
    m = get_molecule(xyz=tmp_path / "water.xyz")
    ref = get_molecule("h2o")
    assert (m.name, m.unit, m.n_electrons) == ("OH2", "angstrom", 10)
    assert m.atoms == ref.atoms  # element case and spacing are free; a trailing blank line is allowed


def test_bohr_coordinates_give_the_same_molecule_as_angstrom():
    """H2 at 0.734 A written in Bohr: the same SCF energy (PySCF converts with the same constant)."""
    d = 0.734 / BOHR_IN_ANGSTROM
    bohr = get_molecule(atom=f"H 0 0 0; H 0 0 {d!r}", unit="bohr")
    angstrom = get_molecule("h2")
    assert bohr.unit == "bohr"
    e_bohr = prepare(bohr, fci=False, cc=False).references.e_hf
    e_angstrom = prepare(angstrom, fci=False, cc=False).references.e_hf
    assert abs(e_bohr - e_angstrom) < 1e-9
    get_molecule(atom="H 0 0 0; H 0 0 0.15")  # 0.15 A is allowed, 0.15 bohr (0.079 A) is not
    with pytest.raises(MoleculeError, match=r"0.15 bohr apart \(< 0.189 bohr\); coordinates are in Bohr"):
        get_molecule(atom="H 0 0 0; H 0 0 0.15", unit="bohr")
    with pytest.raises(MoleculeError, match="built-in molecules are in Angstrom"):
        get_molecule("h2", unit="bohr")
    with pytest.raises(MoleculeError, match="--unit 'nm'"):
        get_molecule(atom="H 0 0 0; H 0 0 1", unit="nm")


@pytest.mark.parametrize(
    "text,match",
    [
        ("", r"w.xyz:1: expected the number of atoms on the first line, got an empty line"),
        ("two\nc\nH 0 0 0\nH 0 0 1\n", r"w.xyz:1: expected the number of atoms on the first line, got 'two'"),
        ("0\nc\n", r"w.xyz:1: the number of atoms must be >= 1"),
        ("2\n", r"w.xyz:2: missing the comment line"),
        ("2\nc\nH 0 0 0\n", r"w.xyz:4: file ends after 1 atoms, but line 1 says 2"),
        ("2\nc\nH 0 0 0\nH 0 0\n", r"w.xyz:4: 'H 0 0' must be 'Element x y z' \(4 fields, got 3\)"),
        ("2\nc\nH 0 0 0\nQ 0 0 1\n", r"w.xyz:4: 'Q 0 0 1': unknown element 'Q'"),
        ("2\nc\nH 0 0 0\nH 0 0 one\n", r"w.xyz:4: 'H 0 0 one': coordinates must be numbers"),
        ("2\nc\nH 0 0 0\nH 0 0 inf\n", r"w.xyz:4: .*must be finite"),
        ("1\nc\nH 0 0 0\nH 0 0 1\n", r"w.xyz:4: more atom lines than the 1 announced on line 1"),
        ("2\nc\nH 0 0 0\nH 0 0 0.05\n", r"w.xyz: atoms 1 \(H\) and 2 \(H\) are 0.05 A apart"),
    ],
)
def test_malformed_xyz_names_file_and_line(tmp_path, text, match):
    (tmp_path / "w.xyz").write_text(text)
    with pytest.raises(MoleculeError, match=match):
        read_xyz(tmp_path / "w.xyz")


def test_unreadable_xyz_is_a_clear_error(tmp_path):
    with pytest.raises(MoleculeError, match="--xyz .*missing.xyz: cannot read it"):
        get_molecule(xyz=tmp_path / "missing.xyz")
    (tmp_path / "bin.xyz").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(MoleculeError, match="bin.xyz: not a text file"):
        read_xyz(tmp_path / "bin.xyz")
    with pytest.raises(MoleculeError, match="exactly one of --molecule NAME, --atom .* or --xyz FILE"):
        get_molecule("h2", xyz=tmp_path / "bin.xyz")


def test_fci_takes_more_roots_only_when_the_lowest_has_the_wrong_spin():
    """O2 in the N_alpha = N_beta sector: its ground state is a triplet, so the lowest root alone is not e_fci; the
    reference then solves for more roots and takes the lowest singlet (an eigenvalue of the exact H), with a note."""
    s = prepare(get_molecule(atom="O 0 0 0; O 0 0 1.21", spin=0), cc=False)
    refs, ham = s.references, s.hamiltonian
    assert len(refs.fci_roots) == 4 and abs(refs.fci_s2[0] - 2.0) < 1e-3
    w = np.linalg.eigvalsh(ham.dense(tokens_to_keys(all_configurations(ham.n_orb, ham.n_alpha, ham.n_beta))))
    assert abs(w[0] - refs.e_fci_sector) < 1e-8
    assert refs.e_fci > refs.e_fci_sector + 1e-3 and np.abs(w - refs.e_fci).min() < 1e-8
    assert any("different total spin" in n for n in refs.notes)
    singlet = prepare(get_molecule("h2o"), cc=False).references  # the usual case: one root suffices
    assert len(singlet.fci_roots) == 1 and singlet.e_fci == singlet.e_fci_sector


def test_ccsd_is_exact_for_two_electrons():
    """For two electrons CCSD is FCI: the reported references agree to well below the mHa the table prints
    (PySCF's default CCSD tolerance left H2's CCSD 1.6e-7 Ha below FCI, printed as "-0.000")."""
    refs = prepare(get_molecule("h2")).references
    assert refs.e_ccsd >= refs.e_fci - 1e-9 and abs(refs.e_ccsd - refs.e_fci) < 1e-8


def test_a_ccsd_t_failure_is_named_as_such_and_keeps_the_ccsd_energy():
    """H2- (ROHF, one beta electron): PySCF's CCSD converges but its (T) fails; the note names CCSD(T), not CCSD,
    and e_ccsd stays (in STO-3G the two alpha electrons fill both orbitals, so HF, CCSD and FCI agree to 1e-12)."""
    refs = prepare(get_molecule("h2", charge=-1, spin=1), cc=True).references
    assert refs.e_ccsd_t is None and refs.e_ccsd is not None
    assert abs(refs.e_ccsd - refs.e_fci) < 1e-9 and abs(refs.e_ccsd - refs.e_hf) < 1e-9
    failed = [n for n in refs.notes if "failed" in n]
    assert len(failed) == 1 and failed[0].startswith("CCSD(T) failed: "), refs.notes


def test_an_xyz_file_with_a_bom_and_crlf_reads_as_without(tmp_path):
    """An editor's UTF-8 byte-order mark made the atom count '\\ufeff2' ("expected the number of atoms")."""
    plain, marked = tmp_path / "plain.xyz", tmp_path / "marked.xyz"
    plain.write_bytes(b"2\nh2\nH 0 0 0\nH 0 0 0.74\n")
    marked.write_bytes(b"\xef\xbb\xbf2\r\nh2\r\nH 0 0 0\r\nH 0 0 0.74\r\n")
    assert read_xyz(marked) == read_xyz(plain)


def test_a_basis_past_the_orbital_limit_is_refused_before_the_scf(tmp_path, capsys, monkeypatch):
    """Ne in aug-cc-pVTZ (46 orbitals, 92 spin orbitals) was refused only after its SCF (16 s here), with advice to
    use an active space, which the CLI has no flag for."""
    def no_scf(*args, **kwargs):
        raise AssertionError("the SCF ran before the size check")

    monkeypatch.setattr(references, "run_scf", no_scf)
    assert main(["nnqs", "--atom", "Ne 0 0 0", "--basis", "aug-cc-pvtz", "--steps", "1", "--no-cc", "--no-fci",
                 "--out", str(tmp_path / "ne")]) == 2
    err = capsys.readouterr().err
    assert "46 spatial orbitals (92 spin orbitals) exceed seqlab.nnqs's limit of 62" in err and "active" not in err

"""Molecule input: built-in names, --atom parsing and charge/spin validation, with errors that say what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

from seqlab.nnqs.molecules import BUILTIN, MoleculeError, get_molecule, parse_atoms
from seqlab.nnqs.references import prepare


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
    from seqlab.nnqs.space import all_configurations, tokens_to_keys

    m = get_molecule(atom="H 0 0 0\nH 0 0 0.9\nH 0 0 1.8", spin=1)
    assert m.name == "H3" and (m.n_alpha, m.n_beta) == (2, 1)
    s = prepare(m, cc=False)
    assert type(s.mf).__name__.startswith("ROHF")
    ham = s.hamiltonian
    w = np.linalg.eigvalsh(ham.dense(tokens_to_keys(all_configurations(ham.n_orb, 2, 1))))
    assert abs(w[0] - s.references.e_fci) < 1e-8
    assert abs(s.references.fci_s2[0] - 0.75) < 1e-6

"""Orbitals fixed by a rule: the same Hamiltonian in every process, and a checkpoint refused in other orbitals."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats

from seqlab.nnqs.driver import run_vmc
from seqlab.nnqs.hamiltonian import Hamiltonian, mo_integrals
from seqlab.nnqs.molecules import get_molecule
from seqlab.nnqs.orbitals import canonical_orbitals, degenerate_blocks
from seqlab.nnqs.references import build_pyscf, run_scf
from seqlab.nnqs.vmc import VMCConfig
from seqlab.runtime.errors import CheckpointError


@pytest.fixture(scope="module")
def n2_scf():
    return run_scf(build_pyscf(get_molecule("n2")))


def _scramble(mf, seed: int) -> np.ndarray:
    """mf's orbitals with each degenerate block rotated at random and every sign flipped at random: another basis an
    eigensolver could have returned."""
    rng = np.random.default_rng(seed)
    c = mf.mo_coeff.copy()
    for idx in degenerate_blocks(mf.mo_energy, mf.mo_occ, 1e-6):
        c[:, idx] = c[:, idx] @ scipy.stats.special_ortho_group.rvs(len(idx), random_state=rng)
    return c * rng.choice([-1.0, 1.0], size=c.shape[1])


def test_n2_has_two_degenerate_pi_pairs(n2_scf):
    blocks = degenerate_blocks(n2_scf.mo_energy, n2_scf.mo_occ, 1e-6)
    assert [len(b) for b in blocks] == [2, 2]  # the occupied pi_u pair and the empty pi_g pair


def test_any_basis_of_a_degenerate_block_gives_the_same_orbitals(n2_scf):
    first = canonical_orbitals(n2_scf.mo_coeff, n2_scf.mo_energy, n2_scf.mo_occ)
    for seed in range(5):
        again = canonical_orbitals(_scramble(n2_scf, seed), n2_scf.mo_energy, n2_scf.mo_occ)
        np.testing.assert_allclose(again, first, atol=1e-9)


def test_canonical_orbitals_stay_orthonormal_canonical_and_pure(n2_scf):
    c = canonical_orbitals(_scramble(n2_scf, 7), n2_scf.mo_energy, n2_scf.mo_occ)
    s = n2_scf.get_ovlp()
    np.testing.assert_allclose(c.T @ s @ c, np.eye(c.shape[1]), atol=1e-9)
    fock = c.T @ n2_scf.get_fock() @ c
    np.testing.assert_allclose(fock, np.diag(n2_scf.mo_energy), atol=1e-7)  # still canonical HF orbitals
    for idx in degenerate_blocks(n2_scf.mo_energy, n2_scf.mo_occ, 1e-6):
        # pure p_x and p_y: the AOs one orbital uses, the other does not touch
        used = np.abs(c[:, idx]) > 1e-8
        assert not np.any(used[:, 0] & used[:, 1])


def test_the_hamiltonian_is_the_same_whatever_basis_scf_returned(n2_scf):
    mf = n2_scf
    mf_a, mf_b = mf.copy(), mf.copy()
    mf_a.mo_coeff = canonical_orbitals(_scramble(mf, 1), mf.mo_energy, mf.mo_occ)
    mf_b.mo_coeff = canonical_orbitals(_scramble(mf, 2), mf.mo_energy, mf.mo_occ)
    for a, b in zip(mo_integrals(mf_a), mo_integrals(mf_b)):
        np.testing.assert_allclose(a, b, atol=1e-8)


def test_a_checkpoint_from_other_orbitals_is_refused(tmp_path, system):
    ham = system("lih").hamiltonian
    out = tmp_path / "run"
    run_vmc(ham, VMCConfig(steps=2, checkpoint_every=1), out=out)
    rng = np.random.default_rng(0)
    rot = scipy.stats.special_ortho_group.rvs(ham.n_orb, random_state=rng)
    h1 = rot.T @ ham.h1 @ rot
    eri = np.einsum("pqrs,pa,qb,rc,sd->abcd", ham.eri, rot, rot, rot, rot)
    rotated = Hamiltonian(h1, eri, ham.e_nuc, ham.n_alpha, ham.n_beta)
    with pytest.raises(CheckpointError, match="other molecular orbitals"):
        run_vmc(rotated, VMCConfig(steps=3), out=out, resume=True)
    res = run_vmc(ham, VMCConfig(steps=3), out=out, resume=True)  # the same orbitals resume as before
    assert [r["step"] for r in res.records] == [0, 1, 2]

"""The sector fast path of exact local energies (H precomputed over the whole (N_alpha, N_beta) sector) against the
per-sample enumeration path, the dense Hamiltonian and FCI."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.sparse.linalg import eigsh

from seqlab.nnqs.ansatz import Wavefunction
from seqlab.nnqs.local_energy import PsiTable, SectorHamiltonian, local_energy
from seqlab.nnqs.molecules import get_molecule
from seqlab.nnqs.references import prepare
from seqlab.nnqs.sampler import enumerate_log_prob
from seqlab.nnqs.space import tokens_to_keys
from seqlab.nnqs.driver import run_vmc
from seqlab.nnqs.exact_sum import sector_log_psi
from seqlab.nnqs.vmc import VMCConfig


def _per_sample(ham, keys, log_psi_of, sector, log_psi_all):
    """The existing exact path, its missing configurations looked up in ``log_psi_all`` (no float32 re-evaluation)."""
    full = PsiTable(sector.keys, log_psi_all)
    return local_energy(ham, keys, log_psi_of, PsiTable(keys, log_psi_of), lambda k: full.lookup(k)[1], "exact")


@pytest.mark.parametrize("name", ["lih", "h2o"])
def test_sector_local_energy_equals_per_sample_path(system, name):
    ham = system(name).hamiltonian
    sector = SectorHamiltonian(ham, progress=False)
    torch.manual_seed(0)
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta)
    log_psi = wf.log_psi(sector.tokens)
    sub = torch.randperm(len(sector), generator=torch.Generator().manual_seed(1))[: len(sector) // 3]
    ref = _per_sample(ham, sector.keys[sub], log_psi[sub], sector, log_psi)
    got = sector.local_energy(sector.keys[sub], log_psi, max_elements=2048)  # several row chunks
    assert (got - ref).abs().max() < 1e-10
    assert got.imag.abs().max() > 1e-3  # a random phase: the complex arithmetic is exercised


def test_per_sample_local_energy_equals_the_sector_path_on_n2():
    """N2 (20 spin orbitals, 14 400 determinants): the two exact paths agree to 1e-10 on a random complex psi.

    A random log psi (no network) keeps this to the cost of building the sector; it exercises every excitation
    class and sign of the larger molecule, which is what the per-sample path must get right past the sector cap.
    """
    ham = prepare(get_molecule("n2"), fci=False, cc=False).hamiltonian
    sector = SectorHamiltonian(ham, progress=False)
    assert len(sector) == 14400
    g = torch.Generator().manual_seed(5)
    log_psi = torch.complex(-8 * torch.rand(len(sector), generator=g, dtype=torch.float64),
                            6.3 * torch.rand(len(sector), generator=g, dtype=torch.float64))
    sub = torch.randperm(len(sector), generator=g)[:400]
    ref = _per_sample(ham, sector.keys[sub], log_psi[sub], sector, log_psi)
    got = sector.local_energy(sector.keys[sub], log_psi)
    assert (got - ref).abs().max() < 1e-10
    assert got.real.abs().max() > 10 and got.imag.abs().max() > 1  # not trivially small numbers


def test_sector_local_energy_survives_a_wide_dynamic_range(system):
    """|psi| spanning e^-400..1 (exp of the raw log psi would underflow): every E_loc is finite and exact."""
    ham = system("h2o").hamiltonian
    sector = SectorHamiltonian(ham, progress=False)
    g = torch.Generator().manual_seed(2)
    log_psi = torch.complex(-400 * torch.rand(len(sector), generator=g, dtype=torch.float64),
                            torch.randn(len(sector), generator=g, dtype=torch.float64))
    got = sector.local_energy(sector.keys, log_psi)
    ref = _per_sample(ham, sector.keys, log_psi, sector, log_psi)
    assert torch.isfinite(got.real).all() and torch.isfinite(got.imag).all()
    assert ((got - ref).abs() / ref.abs().clamp_min(1.0)).max() < 1e-10


def test_sparse_sector_hamiltonian_is_the_dense_one_and_gives_fci(system):
    s = system("h2o")
    ham = s.hamiltonian
    sector = SectorHamiltonian(ham, progress=False)
    dense = ham.dense(sector.keys)
    assert np.abs(sector.matrix.toarray() - dense).max() < 1e-12
    assert sector.matrix.dtype == np.float64 and sector.matrix.nnz == int((dense != 0).sum())
    e0 = eigsh(sector.matrix, k=1, which="SA")[0][0]
    assert abs(e0 - s.references.e_fci) < 1e-8


def test_sector_outside_configuration_is_rejected(system):
    ham = system("lih").hamiltonian
    sector = SectorHamiltonian(ham, progress=False)
    with pytest.raises(ValueError, match="outside"):
        sector.local_energy(torch.tensor([0]), torch.zeros(len(sector), dtype=torch.complex128))


@pytest.mark.parametrize("max_batch", [65536, 7])
def test_enumerated_log_psi_covers_the_sector_and_matches_the_forward(system, max_batch):
    """The prefix-tree walk (KV cache, chunked or not) gives every configuration once, with the forward's log P."""
    ham = system("h2o").hamiltonian
    sector = SectorHamiltonian(ham, progress=False)
    torch.manual_seed(4)
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta)
    tokens, logp = enumerate_log_prob(wf, max_batch=max_batch)
    assert torch.equal(torch.sort(tokens_to_keys(tokens)).values, sector.keys)
    assert (logp - wf.log_prob(tokens)).abs().max() < 1e-5
    assert (sector_log_psi(wf, sector) - wf.log_psi(sector.tokens)).abs().max() < 1e-5


def test_vmc_with_sector_matches_per_sample_vmc(system):
    """Same run with and without the fast path: same energies up to float32 round-off of the network."""
    ham = system("lih").hamiltonian
    a = run_vmc(ham, VMCConfig(steps=3, seed=3, estimator="sampled"))
    b = run_vmc(ham, VMCConfig(steps=3, seed=3, sector_max=0))
    for ra, rb in zip(a.records, b.records):
        assert abs(ra["energy"] - rb["energy"]) < 1e-5 and ra["n_unique"] == rb["n_unique"]
    with pytest.raises(ValueError, match="sector_max"):
        VMCConfig(sector_max=-1)

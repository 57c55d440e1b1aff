"""The Hamiltonian against three independent references: PySCF's FCI energies, PySCF's own determinant-basis
matrix (element by element, signs included), and H applied term by term from its second-quantised definition."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from pyscf import fci
from pyscf.fci import cistring

from seqlab.nnqs.local_energy import PsiTable, local_energy
from seqlab.nnqs.space import all_configurations, tokens_to_keys

MOLECULES = ["h2", "lih", "h2o"]


def full_space_keys(ham) -> torch.Tensor:
    return tokens_to_keys(all_configurations(ham.n_orb, ham.n_alpha, ham.n_beta))


def pyscf_matrix(ham) -> tuple[np.ndarray, torch.Tensor]:
    """PySCF's FCI Hamiltonian (via pspace over the whole space) in seqlab's key order and sign convention.

    PySCF orders a determinant as (all alpha creators)(all beta creators); seqlab interleaves alpha_i, beta_i.
    Reordering the creators costs (-1)^(#pairs alpha i, beta j with j < i).
    """
    n, na, nb = ham.n_orb, ham.n_alpha, ham.n_beta
    stra, strb = cistring.make_strings(range(n), na), cistring.make_strings(range(n), nb)
    dim = len(stra) * len(strb)
    addr, h0 = fci.direct_spin1.pspace(ham.h1, ham.eri, n, (na, nb), np=dim)
    keys, signs = [], []
    for ad in addr:
        ia, ib = divmod(int(ad), len(strb))
        a, b = int(stra[ia]), int(strb[ib])
        keys.append(sum((1 << 2 * i) * (a >> i & 1) + (1 << 2 * i + 1) * (b >> i & 1) for i in range(n)))
        inv = sum(1 for i in range(n) for j in range(i) if a >> i & 1 and b >> j & 1)
        signs.append(-1.0 if inv % 2 else 1.0)
    keys_t = torch.tensor(keys, dtype=torch.int64)
    order = torch.argsort(keys_t).numpy()
    s = np.array(signs)
    P = (s[:, None] * (h0 + ham.e_nuc * np.eye(dim)) * s[None, :])[np.ix_(order, order)]
    return P, keys_t[order]


@pytest.mark.parametrize("name", MOLECULES)
def test_exact_diagonalisation_matches_pyscf_fci(system, name):
    s = system(name)
    w = np.linalg.eigvalsh(s.hamiltonian.dense(full_space_keys(s.hamiltonian)))
    assert abs(w[0] - s.references.e_fci_sector) < 1e-8
    assert abs(w[0] - s.references.e_fci) < 1e-8  # the ground state of these molecules is a singlet


@pytest.mark.parametrize("name", MOLECULES)
def test_connected_rows_match_pyscf_matrix(system, name):
    """Every row of the enumeration (diagonal, which excitations, values, signs) equals PySCF's matrix row."""
    ham = system(name).hamiltonian
    P, keys = pyscf_matrix(ham)
    assert torch.equal(keys, full_space_keys(ham))
    c = ham.connected(keys)
    rows = np.zeros_like(P)
    col = torch.searchsorted(keys, c.keys)
    assert torch.equal(keys[col], c.keys), "an excitation left the fixed-(N_alpha, N_beta) space"
    np.add.at(rows, (c.row.numpy(), col.numpy()), c.elements.numpy())
    rows[np.diag_indices(len(keys))] += c.diagonal.numpy()
    # no excitation may appear twice (np.add.at would double it) and none may be missing
    assert np.abs(rows - P).max() < 1e-10
    off = P - np.diag(np.diag(P))
    assert (np.abs(off) > 1e-10).sum() == (c.elements.abs() > 1e-10).sum()


def _apply_h_brute_force(ham, key: int) -> dict[int, float]:
    """H|x> from the definition, one operator string at a time (O(n^4) per row; only for tiny systems)."""
    N = ham.n_so
    h, g = ham.h_so.numpy(), ham.g.numpy()

    def annihilate(k, p):
        if not k >> p & 1:
            return None, 0
        return k ^ (1 << p), -1 if bin(k & ((1 << p) - 1)).count("1") % 2 else 1

    def create(k, p):
        if k >> p & 1:
            return None, 0
        return k | (1 << p), -1 if bin(k & ((1 << p) - 1)).count("1") % 2 else 1

    out: dict[int, float] = {key: ham.e_nuc}

    def apply(ops, coef):
        k, sign = key, 1
        for kind, p in reversed(ops):  # rightmost operator acts first
            k, s = (annihilate if kind == "a" else create)(k, p)
            if k is None:
                return
            sign *= s
        out[k] = out.get(k, 0.0) + coef * sign

    for p, q in itertools.product(range(N), repeat=2):
        if h[p, q] != 0:
            apply([("c", p), ("a", q)], h[p, q])
    phys = 0.25 * g  # 1/2 sum <pq|rs> a+p a+q a_s a_r == 1/4 sum g[p,q,r,s] a+p a+q a_s a_r
    for p, q, r, s_ in itertools.product(range(N), repeat=4):
        if abs(phys[p, q, r, s_]) > 0:
            apply([("c", p), ("c", q), ("a", s_), ("a", r)], phys[p, q, r, s_])
    return {k: v for k, v in out.items() if abs(v) > 1e-12}


@pytest.mark.parametrize("name,n_rows", [("h2", 4), ("lih", 3)])
def test_connected_matches_second_quantised_definition(system, name, n_rows):
    ham = system(name).hamiltonian
    keys = full_space_keys(ham)[torch.randperm(len(full_space_keys(ham)))[:n_rows]]
    c = ham.connected(keys)
    for r, key in enumerate(keys.tolist()):
        ref = _apply_h_brute_force(ham, key)
        got = {key: float(c.diagonal[r])}
        sel = c.row == r
        got.update(zip(c.keys[sel].tolist(), c.elements[sel].tolist()))
        assert set(got) == set(ref)
        assert max(abs(got[k] - ref[k]) for k in ref) < 1e-10


@pytest.mark.parametrize("name", MOLECULES)
def test_local_energy_of_exact_ground_state_is_fci(system, name):
    s = system(name)
    ham = s.hamiltonian
    keys = full_space_keys(ham)
    w, v = np.linalg.eigh(ham.dense(keys))
    psi = torch.from_numpy(v[:, 0]).to(torch.complex128)
    support = psi.abs() > 1e-6 * psi.abs().max()  # amplitudes that vanish by symmetry make E_loc 0/0
    log_psi = torch.log(psi[support])
    table = PsiTable(keys[support], log_psi)

    def evaluate(k):  # configurations outside the support have psi = 0 (log psi = -inf -> ratio 0)
        found, vals = PsiTable(keys[support], log_psi).lookup(k)
        return torch.where(found, vals, torch.full_like(vals, complex(-1e4, 0)))

    e = local_energy(ham, keys[support], log_psi, table, evaluate, mode="exact", max_elements=4096)
    assert int(support.sum()) > 1
    assert (e - s.references.e_fci).abs().max() < 1e-7
    assert e.imag.abs().max() < 1e-12


def test_sample_space_local_energy_drops_unsampled_configurations(system):
    """With every configuration 'sampled', the sample-space mode equals the exact one; with a subset it differs."""
    ham = system("lih").hamiltonian
    keys = full_space_keys(ham)
    g = torch.Generator().manual_seed(0)
    log_psi = torch.randn(len(keys), generator=g, dtype=torch.float64).to(torch.complex128)
    full = PsiTable(keys, log_psi)
    exact = local_energy(ham, keys, log_psi, full, full.lookup and (lambda k: full.lookup(k)[1]), mode="exact")
    ss = local_energy(ham, keys, log_psi, PsiTable(keys, log_psi), mode="sample-space")
    assert (exact - ss).abs().max() < 1e-12
    sub = torch.arange(0, len(keys), 3)
    ss_sub = local_energy(ham, keys[sub], log_psi[sub], PsiTable(keys[sub], log_psi[sub]), mode="sample-space")
    # by hand: diagonal plus only the sampled neighbours
    c = ham.connected(keys[sub])
    inside = torch.isin(c.keys, keys[sub])
    pos = torch.searchsorted(keys, c.keys)
    manual = c.diagonal.to(torch.complex128).clone()
    contrib = c.elements * torch.exp(log_psi[pos] - log_psi[sub][c.row]).real * inside
    manual.index_add_(0, c.row, contrib.to(torch.complex128))
    assert (ss_sub - manual).abs().max() < 1e-10
    assert (ss_sub - exact[sub]).abs().max() > 1e-3

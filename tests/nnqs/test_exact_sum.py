"""The exact-sum estimator: E = <psi|H|psi>/<psi|psi> over the whole sector and its exact gradient, no sampling."""

from __future__ import annotations

import pytest
import torch

from seqlab.nnqs.ansatz import AnsatzConfig, Wavefunction
from seqlab.nnqs.driver import run_vmc
from seqlab.nnqs.exact_sum import exact_sum, gradient_set, sector_log_psi
from seqlab.nnqs.local_energy import PsiTable, SectorHamiltonian, local_energy
from seqlab.nnqs.space import tokens_to_keys
from seqlab.nnqs.vmc import VMCConfig, make_evaluator, vmc_step
from seqlab.nnqs.warm_start import WarmStartConfig, fit, target_state
from seqlab.runtime.dist import DistInfo

TINY = AnsatzConfig(d_model=16, n_layers=1, n_heads=2, phase_hidden=16, phase_layers=1)


def _dense_energy(wf: Wavefunction, sector: SectorHamiltonian, dense: torch.Tensor) -> torch.Tensor:
    """E(θ) = <psi|H|psi>/<psi|psi> from the differentiable forward over every configuration, dense H."""
    logp, phase = wf(sector.tokens)
    log_psi = torch.complex(0.5 * logp.double(), phase.double())
    psi = torch.exp(log_psi - log_psi.real.max().detach())
    h_psi = dense.to(torch.complex128) @ psi
    return ((psi.conj() * h_psi).sum() / (psi.abs() ** 2).sum()).real


def test_exact_sum_energy_is_the_expectation_over_the_whole_sector(system):
    """E and its variance equal sum_x P(x) E_loc(x) from the independent per-sample path, and the dense <H>."""
    ham = system("h2o").hamiltonian
    sector = SectorHamiltonian(ham, progress=False)
    torch.manual_seed(1)
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta)
    ex = exact_sum(wf, sector, tail=1e-3, max_configs=10**6)
    log_psi = sector_log_psi(wf, sector)
    p = torch.exp(2 * log_psi.real)
    p = p / p.sum()
    eloc = local_energy(ham, sector.keys, log_psi, PsiTable(sector.keys, log_psi), make_evaluator(wf), "exact")
    e_ref = complex((p * eloc).sum())
    assert abs(ex.energy - e_ref) < 1e-10
    assert abs(ex.variance - float((p * eloc.abs() ** 2).sum() - abs(e_ref) ** 2)) < 1e-8
    psi = torch.exp(log_psi)
    dense = torch.from_numpy(ham.dense(sector.keys)).to(torch.complex128)
    assert abs(ex.energy - complex(psi.conj() @ dense @ psi / (psi.abs() ** 2).sum())) < 1e-10
    # the gradient set: the most probable configurations, all but 1e-3 of the mass, with their exact E_loc
    assert 0 < ex.tail_mass <= 1e-3 and ex.n_kept < len(sector)
    kept = torch.isin(sector.keys, tokens_to_keys(ex.tokens))
    assert int(kept.sum()) == ex.n_kept and float(p[kept].min()) >= float(p[~kept].max())  # the most probable
    assert abs(float(p[~kept].sum()) - ex.tail_mass) < 1e-12
    assert (ex.weights - PsiTable(sector.keys, p.to(torch.complex128)).lookup(tokens_to_keys(ex.tokens))[1].real
            ).abs().max() < 1e-15
    found, ref = PsiTable(sector.keys, eloc).lookup(tokens_to_keys(ex.tokens))
    assert bool(found.all()) and (ex.eloc - ref).abs().max() < 1e-10


@pytest.mark.parametrize("tail", [0.0, 0.02])
def test_exact_sum_step_follows_the_exact_energy_gradient(system, tail):
    """One vmc_step (plain SGD, no clipping) moves θ by -lr dE/dθ, dE/dθ from autograd of the dense energy.

    With tail 0 the step is the exact gradient (float32 network: < 1e-3 relative); with a tail of 0.02 only the
    least probable configurations (2 % of the mass, 24 of 225) are left out and the direction moves a little
    (measured: 4.4 % of its norm).
    """
    ham = system("lih").hamiltonian
    sector = SectorHamiltonian(ham, progress=False)
    dense = torch.from_numpy(ham.dense(sector.keys))
    torch.manual_seed(2)
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta, TINY)
    energy = _dense_energy(wf, sector, dense)
    grad = torch.cat([g.flatten() for g in torch.autograd.grad(energy, list(wf.parameters()))]).double()
    before = torch.cat([p.detach().flatten() for p in wf.parameters()]).double()
    lr = 1e-3
    cfg = VMCConfig(steps=1, lr=lr, warmup=0, min_lr_ratio=1.0, grad_clip=None, anneal=0.0, exact_tail=tail)
    st = vmc_step(wf, ham, torch.optim.SGD(wf.parameters(), lr=lr), cfg, 0, DistInfo(), sector=sector)
    after = torch.cat([p.detach().flatten() for p in wf.parameters()]).double()
    step_grad = (before - after) / lr
    assert abs(st.energy - float(energy.detach())) < 1e-6 and st.energy_std == 0.0
    rel = float((step_grad - grad).norm() / grad.norm())
    if tail == 0.0:
        assert st.n_unique == len(sector) and st.tail_mass < 1e-12 and rel < 1e-3
    else:
        assert st.n_unique < len(sector) and 0 < st.tail_mass <= tail and 1e-3 < rel < 0.1


def test_gradient_set_is_the_smallest_prefix_of_the_most_probable():
    prob = torch.tensor([0.05, 0.5, 0.0, 0.3, 0.15], dtype=torch.float64)
    assert gradient_set(prob, 0.0, 10).tolist() == [1, 3, 4, 0]  # zero-probability configurations are not kept
    assert gradient_set(prob, 0.06, 10).tolist() == [1, 3, 4]  # 0.05 + 0 left out
    assert gradient_set(prob, 0.2, 10).tolist() == [1, 3]  # 0.15 + 0.05 = 0.2 left out: still within the tail
    assert gradient_set(prob, 0.0, 2).tolist() == [1, 3]  # the cap
    assert gradient_set(prob, 0.99, 10).tolist() == [1]  # never empty


def test_exact_sum_keeps_a_gradient_where_capped_sampling_sees_only_hartree_fock(system):
    """The collapse onto HF: with P(HF) > 1 - 1/N_s every sample is HF, E_loc - E = 0 and the sampled gradient is 0;
    the exact sum still sees the excited configurations and its step lowers the energy."""
    s = system("lih")
    ham = s.hamiltonian
    torch.manual_seed(0)
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta, TINY)
    hf = target_state("hf", s.mf, ham.n_orb, ham.n_alpha, ham.n_beta)
    fit(wf, hf, WarmStartConfig(steps=300, lr=1e-2, min_lr_ratio=1.0))  # a constant rate: P(HF) -> 1
    sector = SectorHamiltonian(ham, progress=False)
    ex = exact_sum(wf, sector, 0.0, 10**6)
    p_hf = float(ex.weights.max())
    assert 1 - p_hf < 1e-3  # the state sits on HF
    common = dict(steps=1, lr=1e-4, warmup=0, min_lr_ratio=1.0, anneal=0.0, grad_clip=None)
    sampled = VMCConfig(estimator="sampled", samples=100, **common)
    wf_s = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta, TINY)
    wf_s.load_state_dict(wf.state_dict())
    opt = torch.optim.SGD(wf_s.parameters(), lr=1e-4)
    st = vmc_step(wf_s, ham, opt, sampled, 0, DistInfo(), sector=sector)
    assert st.n_unique == 1  # only HF was drawn
    assert all(float(p.grad.abs().max()) == 0.0 for p in wf_s.parameters())
    st = vmc_step(wf, ham, torch.optim.SGD(wf.parameters(), lr=1e-4), VMCConfig(**common), 0, DistInfo(),
                  sector=sector)
    assert st.n_unique > 1 and any(float(p.grad.abs().max()) > 0 for p in wf.parameters())
    # and it descends: 40 exact-sum AdamW steps from the HF state (measured: HF + 1.68 -> HF + 0.47 mHa; the
    # excitations grow from ~1e-4 amplitudes slowly, which is why an HF fit is not the warm-start fallback)
    cfg = VMCConfig(**{**common, "steps": 40, "lr": 1e-3})
    opt = torch.optim.AdamW(wf.parameters(), lr=1e-3)
    energies = [vmc_step(wf, ham, opt, cfg, i, DistInfo(), sector=sector).energy for i in range(40)]
    assert energies[-1] < energies[0] - 5e-4


def test_exact_sum_config_errors_name_the_field(system):
    with pytest.raises(ValueError, match="VMCConfig.estimator"):
        VMCConfig(estimator="exact")
    with pytest.raises(ValueError, match="VMCConfig.exact_tail"):
        VMCConfig(exact_tail=1.0)
    with pytest.raises(ValueError, match="VMCConfig.exact_max_configs"):
        VMCConfig(exact_max_configs=0)
    with pytest.raises(ValueError, match="VMCConfig.estimator.*sector fast path"):
        run_vmc(system("h2").hamiltonian, VMCConfig(estimator="exact-sum", sector_max=0, steps=1))

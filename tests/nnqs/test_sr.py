"""Stochastic reconfiguration: the minSR kernel solve is the natural gradient, and it points downhill."""
from __future__ import annotations

import torch

from seqlab.nnqs.ansatz import AnsatzConfig, Wavefunction
from seqlab.nnqs.local_energy import PsiTable, local_energy
from seqlab.nnqs.space import all_configurations, tokens_to_keys
from seqlab.nnqs.sr import sr_direction
from seqlab.nnqs.vmc import make_evaluator


def _per_sample_jacobian(wf, tokens, params):
    rows = []
    for k in range(len(tokens)):
        lp, ph = wf(tokens[k : k + 1])
        g_re = torch.autograd.grad(0.5 * lp.sum(), params, allow_unused=True)
        g_im = torch.autograd.grad(ph.sum(), params, allow_unused=True)
        flat = lambda gs: torch.cat([(g if g is not None else torch.zeros_like(p)).flatten()  # noqa: E731
                                     for g, p in zip(gs, params)])
        rows.append(torch.complex(flat(g_re).double(), flat(g_im).double()))
    return torch.stack(rows)  # O[k] = d log psi(x_k) / d theta


def test_sr_direction_solves_the_parameter_space_equation_and_descends(system):
    ham = system("lih").hamiltonian
    torch.manual_seed(0)
    tiny = AnsatzConfig(d_model=8, n_layers=1, n_heads=2, phase_hidden=8, phase_layers=1)  # S is P x P: keep P small
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta, tiny)
    tokens = all_configurations(ham.n_orb, ham.n_alpha, ham.n_beta)[::9][:40]  # a sample set of 40 configs
    keys = tokens_to_keys(tokens)
    with torch.no_grad():
        log_psi = wf.log_psi(tokens)
    w = torch.rand(len(tokens), dtype=torch.float64)
    w /= w.sum()  # sample weights (counts / N_s)
    eloc = local_energy(ham, keys, log_psi, PsiTable(keys, log_psi), make_evaluator(wf), "exact")
    energy = complex((w * eloc).sum())
    params = [p for p in wf.parameters() if p.requires_grad]
    shift = 1e-2

    wf.zero_grad(set_to_none=True)
    sr_direction(wf, tokens, w, eloc, energy, shift)
    delta = torch.cat([p.grad.flatten().double() for p in params])

    # the same update from the P x P equation (S + lambda) delta = F, built explicitly
    O = _per_sample_jacobian(wf, tokens, params)
    sw = w.sqrt()[:, None]
    Oc = sw * (O - (w[:, None] * O).sum(0, keepdim=True))
    eps = w.sqrt() * (eloc - energy)
    Or, er = torch.cat((Oc.real, Oc.imag)), torch.cat((eps.real, eps.imag))
    lam = shift * (Or * Or).sum(1).mean()  # the kernel's mean diagonal, as the implementation scales it
    S, F = Or.T @ Or, Or.T @ er
    direct = torch.linalg.solve(S + lam * torch.eye(len(S), dtype=S.dtype), F)
    # float32 Jacobian and kernel products (a float64 solve): measured 1e-5 relative to the float64 P x P solve
    assert float((delta - direct).norm()) < 1e-4 * float(direct.norm())

    # F is (half) the energy gradient, 2 Re E[(E_loc - E)^* O]: a step along -delta lowers the energy to first order
    grad = 2 * (w[:, None] * (eloc - energy).conj()[:, None] * (O - (w[:, None] * O).sum(0))).sum(0).real
    assert torch.allclose(F, grad / 2, rtol=1e-6, atol=1e-9 * grad.abs().max())
    assert float(delta @ grad) > 0

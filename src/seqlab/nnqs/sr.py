"""Stochastic reconfiguration in its sample-space (minSR) form: the natural-gradient direction of one VMC step.

minSR solves the preconditioned equation through the U x U kernel of the samples instead of the P x P quantum
geometric tensor, so it is cheap when there are far fewer unique samples U than parameters P.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seqlab.nnqs.ansatz import Wavefunction


def sr_direction(wf: Wavefunction, tokens: Tensor, w: Tensor, eloc: Tensor, energy: complex, shift: float) -> None:
    """Replace .grad by the minSR natural-gradient direction (single process; U x U kernel).

    O_k = d log psi(x_k)/dθ (complex), centred and scaled by sqrt(w_k): the update solves
    (S + shift) δ = F in parameter space through the U x U kernel T = O O^† (cheap when U << n_params).
    """
    params = [p for p in wf.parameters() if p.requires_grad]
    rows_re, rows_im = [], []
    for k in range(len(tokens)):  # per-sample gradients; SR is meant for small sample sets
        lp, ph = wf(tokens[k : k + 1])
        g_re = torch.autograd.grad(0.5 * lp.sum(), params, allow_unused=True)
        g_im = torch.autograd.grad(ph.sum(), params, allow_unused=True)
        rows_re.append(torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(g_re, params)]))
        rows_im.append(torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(g_im, params)]))
    O = torch.complex(torch.stack(rows_re).double(), torch.stack(rows_im).double())
    sw = w.sqrt()[:, None]
    O = sw * (O - (w[:, None] * O).sum(0, keepdim=True))
    eps = sw.squeeze(1) * (eloc - energy)  # centred, weighted local energies
    # real parametrisation: stack real and imaginary parts (S and F are real for real parameters)
    Or = torch.cat((O.real, O.imag), 0)
    er = torch.cat((eps.real, eps.imag), 0)
    T = Or @ Or.T
    T = T + shift * T.diagonal().mean().clamp_min(1e-12) * torch.eye(len(T), dtype=T.dtype)
    delta = Or.T @ torch.linalg.solve(T, er)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = delta[offset : offset + n].view_as(p).to(p.dtype).clone()
        offset += n

"""Stochastic reconfiguration in its sample-space (minSR) form: the natural-gradient direction of one VMC step.

minSR solves the preconditioned equation through the U x U kernel of the samples instead of the P x P quantum
geometric tensor, so it is cheap when there are far fewer unique samples U than parameters P. The per-sample
gradients O_k = d log psi(x_k)/dθ come from one vectorised Jacobian (``torch.func``), not a Python loop.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from torch.func import functional_call, jacrev, vmap

from seqlab.nnqs.ansatz import Wavefunction


def log_psi_jacobian(wf: Wavefunction, tokens: Tensor, chunk: int = 64) -> Tensor:
    """[U, 2, P] float32: d(1/2 log P)/dθ and dphi/dθ of each configuration, over ``wf.parameters()`` in order.

    Configurations do not interact in the forward pass (no batch statistics), so vmap over single-row forwards is
    the per-sample gradient. ``chunk`` rows are vectorised together (memory ~ chunk x the activations of one row).
    """
    names = [n for n, p in wf.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in wf.named_parameters() if p.requires_grad}

    def parts(theta: dict, t: Tensor) -> Tensor:
        lp, ph = functional_call(wf, theta, (t[None],))
        return torch.stack((0.5 * lp[0], ph[0]))

    with warnings.catch_warnings():  # CPU attention has no batching rule: the (correct) fallback warns each call
        warnings.filterwarnings("ignore", message=".*batching rule.*")
        jac = vmap(jacrev(parts), in_dims=(None, 0), chunk_size=chunk)(params, tokens)
    return torch.cat([jac[n].reshape(len(tokens), 2, -1) for n in names], -1)


def sr_direction(wf: Wavefunction, tokens: Tensor, w: Tensor, eloc: Tensor, energy: complex, shift: float) -> None:
    """Replace .grad by the minSR natural-gradient direction (single process; U x U kernel).

    O_k = d log psi(x_k)/dθ (complex), centred and scaled by sqrt(w_k): the update solves
    (S + shift) δ = F in parameter space through the U x U kernel T = O O^† (cheap when U << n_params).
    ``w`` is renormalised over the given configurations (an exact-sum gradient set holds slightly less than 1).
    """
    params = [p for p in wf.parameters() if p.requires_grad]
    w = (w / w.sum()).float()
    jac = log_psi_jacobian(wf, tokens)
    sw = w.sqrt()[:, None]
    # real parametrisation: the rows of Re O and Im O stacked (S and F are real for real parameters); float32
    # products, a float64 solve
    re = sw * (jac[:, 0] - (w[:, None] * jac[:, 0]).sum(0, keepdim=True))
    im = sw * (jac[:, 1] - (w[:, None] * jac[:, 1]).sum(0, keepdim=True))
    del jac
    eps = w.double().sqrt() * (eloc - energy)  # centred, weighted local energies
    er = torch.cat((eps.real, eps.imag), 0)
    T = _gram(re, im)
    T = T + shift * T.diagonal().mean().clamp_min(1e-12) * torch.eye(len(T), dtype=T.dtype)
    x = torch.linalg.solve(T, er).float()
    delta = re.T @ x[: len(re)] + im.T @ x[len(re) :]
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = delta[offset : offset + n].view_as(p).to(p.dtype).clone()
        offset += n


def _gram(re: Tensor, im: Tensor) -> Tensor:
    """[[re re^T, re im^T], [im re^T, im im^T]] in float64, each block over the columns both factors touch.

    log P depends on the decoder only and phi on the phase MLP only, so re and im share no column and the
    off-diagonal blocks vanish; restricting the products to the nonzero columns makes T about 4x cheaper.
    """
    nz_re, nz_im = re.ne(0).any(0), im.ne(0).any(0)
    both = nz_re & nz_im

    def block(a: Tensor, b: Tensor, cols: Tensor) -> Tensor:
        if not bool(cols.any()):
            return torch.zeros(len(a), len(b), dtype=torch.float64)
        return (a[:, cols] @ b[:, cols].T).double()

    off = block(re, im, both)
    return torch.cat((torch.cat((block(re, re, nz_re), off), 1), torch.cat((off.T, block(im, im, nz_im)), 1)), 0)

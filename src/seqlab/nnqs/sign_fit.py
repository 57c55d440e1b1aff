"""Teach the phase network the signs of the selected space's own ground state (selected CI), between VMC steps.

Why: on H2O/6-31G the selected-sum run's psi ends 1.43 mHa above the best state on its space S, and a quarter of
that is signs. 2 199 of S's 9 286 configurations carry the wrong sign; they hold only 2e-5 of the weight, so their
phase gradients (~|psi|^2) are too small for VMC ever to turn them, and a wrong sign also holds their amplitude
down. H's lowest eigenvector on S costs a Lanczos solve (0.2 s there) and knows every one of those signs, so the
phase MLP, which is cheap next to the decoder, is fitted to it for some thousand Adam steps every so many VMC steps.
The amplitudes stay VMC's: only the phase network moves. The loss is the warm start's sum_x w_x (1 - cos(phi_x -
arg c_x)), with w ~ sqrt|c|: |c| weights (the warm start's) leave the small configurations' signs wrong, uniform
weights turn them but loosen the large ones' phases and cost tens of mHa (docs/nnqs.md).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from seqlab.nnqs.ansatz import Wavefunction
from seqlab.nnqs.warm_start import phase_mismatch
from seqlab.runtime.schedule import warmup_cosine

SIGN_FIT_LR = 3e-3  # peak Adam rate, cosine decay to 5 % over each fit
SIGN_FIT_MIN_LR_RATIO = 0.05


def sign_targets(wf: Wavefunction, tokens: Tensor, coeffs: np.ndarray) -> tuple[Tensor, Tensor]:
    """(wanted phase per configuration, loss weights) for a real state ``coeffs`` on ``tokens``; the overall phase
    is psi's own (the argument of <coeffs|psi>), so a fit of signs leaves the global phase where it is."""
    c = torch.as_tensor(coeffs, dtype=torch.float64)
    log_psi = wf.log_psi(tokens)
    overlap = complex((c.to(torch.complex128) * torch.exp(log_psi - log_psi.real.max())).sum())
    want = (torch.where(c < 0, math.pi, 0.0) + math.atan2(overlap.imag, overlap.real)).float()
    weight = c.abs().float().sqrt()
    return want, weight / weight.sum()


def fit_signs(wf: Wavefunction, tokens: Tensor, coeffs: np.ndarray, steps: int, lr: float = SIGN_FIT_LR) -> float:
    """Fit ``wf``'s phase network to the signs of ``coeffs`` over ``tokens`` for ``steps`` Adam steps (a fresh
    optimiser each call: the VMC optimiser's moments are left alone); returns the final loss."""
    want, weight = sign_targets(wf, tokens, coeffs)
    opt = torch.optim.Adam(wf.phase_net.parameters(), lr=lr)
    loss = torch.zeros(())
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = warmup_cosine(step, max(steps - 1, 1), lr, 0, SIGN_FIT_MIN_LR_RATIO)
        loss = phase_mismatch(wf.phase(tokens), want, weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return loss.item()

"""Supervised warm start: teach the wavefunction a cheap quantum-chemistry state before VMC starts.

Why: from a random start the first VMC steps gain tens of Hartree by concentrating P on Hartree-Fock, and once the
excited amplitudes are tiny their gradients (and their signs' gradients) vanish; N2 collapsed onto HF in 2 of 3
runs that way. CCSD (PySCF, polynomial cost; ``coupled_cluster.py``) knows the amplitude and sign of every single
and double excitation and, through exp(T), of the disconnected triples and quadruples that CISD lacks (a CISD start
left N2 seed 1 on a 3.9 mHa plateau of wrong small-amplitude signs; from CCSD the same seed ends at 1.10 mHa).
Fitting it is the language-model objective on determinant "sentences" (cross-entropy weighted by |c|^2, teacher
forcing) plus a phase loss, so VMC starts below HF with the right sign structure and needs no entropy annealing.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from seqlab import runtime
from seqlab.nnqs.active_space import casci_fcivec
from seqlab.nnqs.ansatz import Wavefunction
from seqlab.nnqs.coupled_cluster import ccsd_fcivec, perturbed_state, state_energy
from seqlab.nnqs.space import keys_to_tokens
from seqlab.runtime.schedule import warmup_cosine

METHODS = ("ccsd", "cisd", "casci", "hf", "none")
PHASE_WEIGHTS = ("amplitude", "probability")
# configurations with |c|^2 below this are left out of the fit: the cross-entropy weighs by |c|^2 and the phase loss
# by |c| (under 1e-4 of the largest), so they barely move it, while each costs a forward pass per step (CCSD puts 7 247 of C2's determinants above |c| = 1e-8, 1 074 above
# |c|^2 = 1e-8 holding all but 2e-6 of the weight: 1.4 s a fit step against 0.2 s)
SUPPORT_EPS = 1e-8
# and at most this many, the largest |c|: a fit step costs ~0.3 ms per configuration (H2O/6-31G: CCSD puts 5 641
# above SUPPORT_EPS, 2 s a step, 50 minutes for the fit). N2 and C2 in STO-3G have fewer, so the cap leaves them as
# they were; on H2O/6-31G the 4 096 largest hold all but 2.3e-5 of the weight
MAX_FIT_CONFIGS = 2048
MAX_FCIVEC = 20_000_000  # CISD is mapped through PySCF's FCI-sized vector; past this it would not fit in memory


@dataclass
class WarmStartConfig:
    method: str = "ccsd"
    steps: int = 1500
    lr: float = 3e-3
    # cosine decay to lr * min_lr_ratio at the last step: at a constant 3e-3 some seeds stay in a poor fit (H2O
    # seed 1: overlap 0.978, 245 mHa above FCI after 600 or 2000 steps; at 1e-3 N2 seed 0 ended at overlap 0.90).
    # With the decay over 1500 steps: H2O seeds 0/1 7.9/7.5 mHa above FCI, N2 seeds 0/1/2 28.6/24.3/39.5 mHa
    # (CISD itself: 1.2 and 18.3 mHa), C2 58.7 mHa (CISD 53.7); 0.02 s a step for N2's ~600 CISD determinants
    min_lr_ratio: float = 0.02
    # what weighs each configuration's sign in the phase loss: |c| ("amplitude") or |c|^2 ("probability", the
    # cross-entropy's weight). Under |c|^2 a configuration of weight 1e-5 barely moves the loss, so its phase is left
    # loose (N2: median 0.66 rad off on the 92 configurations, 1.3e-4 of FCI's weight, that VMC later drove to ~1e-20:
    # a wrong-ish sign makes less amplitude the quick energy gain, and then the gradient, ~|psi|, is gone). Under |c|
    # the same fit leaves them 0.08 rad off; the amplitude network's fit is unchanged (docs/nnqs.md)
    phase_weight: str = "amplitude"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"WarmStartConfig.method: {self.method!r} not in {METHODS}")
        if not self.steps >= 0:
            raise ValueError(f"WarmStartConfig.steps: must be >= 0, got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"WarmStartConfig.lr: must be > 0, got {self.lr}")
        if not 0 < self.min_lr_ratio <= 1:
            raise ValueError(f"WarmStartConfig.min_lr_ratio: must be in (0, 1], got {self.min_lr_ratio}")
        if self.phase_weight not in PHASE_WEIGHTS:
            raise ValueError(f"WarmStartConfig.phase_weight: {self.phase_weight!r} not in {PHASE_WEIGHTS}")


@dataclass
class TargetState:
    """A normalised real state on a few configurations: seqlab keys and coefficients in seqlab's sign convention."""

    keys: Tensor  # [M] int64
    coeffs: Tensor  # [M] float64, sum of squares 1
    method: str
    energy: float | None = None  # the method's own energy (PySCF), for the log
    variational_energy: float | None = None  # <c|H|c> of the state itself (CCSD's energy above is projected)


def pyscf_vector_to_keys(vec: np.ndarray, n_orb: int, n_alpha: int, n_beta: int) -> tuple[Tensor, Tensor]:
    """PySCF's determinant vector [n_alpha_strings, n_beta_strings] -> (seqlab keys, coefficients), signs mapped.

    PySCF orders a determinant as (all alpha creators)(all beta creators); seqlab interleaves alpha_i, beta_i.
    Moving each alpha creator past the beta creators of lower orbitals costs (-1)^(#pairs alpha i, beta j, j < i).
    """
    from pyscf.fci import cistring  # optional heavy dependency (the nnqs extra)

    alpha = np.asarray(cistring.make_strings(range(n_orb), n_alpha), dtype=np.int64)
    beta = np.asarray(cistring.make_strings(range(n_orb), n_beta), dtype=np.int64)
    vec = np.asarray(vec, dtype=np.float64).reshape(len(alpha), len(beta))
    keys = np.zeros(vec.shape, dtype=np.int64)
    swaps = np.zeros(vec.shape, dtype=np.int64)
    beta_below = np.zeros_like(beta)  # beta electrons in orbitals < i
    for i in range(n_orb):
        a_i, b_i = (alpha >> i) & 1, (beta >> i) & 1
        keys += (a_i[:, None] << (2 * i)) + (b_i[None, :] << (2 * i + 1))
        swaps += a_i[:, None] * beta_below[None, :]
        beta_below = beta_below + b_i
    signs = np.where(swaps % 2 == 1, -1.0, 1.0)
    return torch.from_numpy(keys.ravel()), torch.from_numpy((vec * signs).ravel())


def target_state(method: str, mf, n_orb: int, n_alpha: int, n_beta: int,
                 support: float = SUPPORT_EPS, max_configs: int = MAX_FIT_CONFIGS,
                 perturb: bool = False) -> TargetState | None:
    """The state to fit: CCSD's exp(T)|HF>, CISD or a valence CASCI from PySCF on ``mf``'s orbitals, or the HF
    determinant; None for "none". Where CCSD does not converge (a stretched bond), "ccsd" fits the lower in energy of
    CISD and CASCI, which there is CASCI (``active_space.py``). Configurations with |c|^2 <= ``support`` are left
    out (0 keeps every nonzero one), and past ``max_configs`` the smallest. ``perturb`` adds one Epstein-Nesbet step
    to the chosen state (``coupled_cluster.perturbed_state``; its name gains "+pt"), kept only if it lowers the
    variational energy.

    CCSD and CISD are not available for open shells, where PySCF's are not spin-restricted, nor for spaces too large
    for PySCF's FCI-sized vector; then this warns and returns None, a random start (with annealing, ``recipe.py``).
    Not HF: a state fitted to one determinant puts ~1e-10 on every excitation, and VMC does not leave it (OH
    radical, STO-3G: 25.7 mHa after 400 steps from HF, the HF error itself; 1.9 mHa from a random start).
    """
    if method == "none":
        return None
    hf_key = sum(1 << (2 * i) for i in range(n_alpha)) + sum(1 << (2 * i + 1) for i in range(n_beta))
    hf = TargetState(torch.tensor([hf_key]), torch.ones(1, dtype=torch.float64), "hf", float(mf.e_tot), float(mf.e_tot))
    if method == "hf":
        return hf
    if n_alpha != n_beta or math.comb(n_orb, n_alpha) * math.comb(n_orb, n_beta) > MAX_FCIVEC:
        warnings.warn(f"warm start: CCSD and CISD need a closed shell and at most {MAX_FCIVEC} determinants here; "
                      f"starting from a random state with entropy annealing instead", stacklevel=2)
        return None
    from pyscf import ci as pyscf_ci  # optional heavy dependency (the nnqs extra)

    nelec = (n_alpha, n_beta)
    candidates = {}  # method -> (vector, the method's own energy, the vector's variational energy)
    if method == "ccsd":
        ccsd = ccsd_fcivec(mf, n_orb, nelec)
        if ccsd is not None:  # CCSD's energy is projected: the state's own energy takes one H application
            candidates["ccsd"] = (*ccsd, state_energy(mf, ccsd[0], n_orb, nelec))
    fallback = method == "ccsd" and not candidates
    if method == "cisd" or fallback:
        solver = pyscf_ci.CISD(mf)
        solver.verbose = 0
        solver.kernel()
        candidates["cisd"] = (solver.to_fcivec(solver.ci, n_orb, nelec), float(solver.e_tot), float(solver.e_tot))
    if method == "casci" or fallback:
        vec, energy = casci_fcivec(mf, n_orb, nelec)
        candidates["casci"] = (vec, energy, energy)
    # where CCSD failed (static correlation) both variational fallbacks are solved and the lower one is fitted. Not
    # the lowest of all three where CCSD converges: N2 at 2.0 Å from CASCI (18 mHa) was at 9.3 mHa after 700 VMC
    # steps, from CCSD's state (57 mHa) at 2.3; CCSD holds the doubles' signs that VMC is slow to find
    method = min(candidates, key=lambda m: candidates[m][2])
    vec, energy, variational = candidates[method]
    if perturb:
        corrected, _, after = perturbed_state(mf, vec, n_orb, nelec)
        if after <= variational + 1e-10:  # equal where the state is already exact (two electrons)
            vec, variational, method = corrected, after, f"{method}+pt"
        else:
            warnings.warn(f"warm start: the perturbative step raised {method}'s energy ({variational:.6f} -> "
                          f"{after:.6f} Ha); fitting {method} without it", stacklevel=2)
    keys, coeffs = pyscf_vector_to_keys(vec, n_orb, n_alpha, n_beta)
    keep = coeffs**2 > support
    keys, coeffs = keys[keep], coeffs[keep]
    if len(coeffs) > max_configs:  # the largest |c| only: each fit step is a forward and backward over all of them
        top = torch.topk(coeffs.abs(), max_configs).indices
        keys, coeffs = keys[top], coeffs[top]
    return TargetState(keys, coeffs / coeffs.norm(), method, energy, variational)


def fit(wf: Wavefunction, target: TargetState, cfg: WarmStartConfig, progress: bool = False,
        should_stop: Callable[[int], bool] | None = None) -> dict | None:
    """Fit P to |c|^2 (weighted cross-entropy) and phi to the signs of c; returns the final losses and overlap, or
    None when ``should_stop(step)`` turned true first (a signal: a half-fitted state is not worth keeping).

    The phase loss sum v (1 - cos(phi - arg c)) is zero exactly when every sign is right, whatever the offset
    conventions. The cross-entropy weighs by |c|^2, so what VMC will see most is fitted best; the phase loss by |c|
    (``cfg.phase_weight``), so small configurations get their signs too.
    """
    tokens = keys_to_tokens(target.keys, wf.n_orb)
    weight = (target.coeffs**2).float()
    amplitude = target.coeffs.abs().float()
    sign_weight = weight if cfg.phase_weight == "probability" else amplitude / amplitude.sum()
    want = torch.where(target.coeffs < 0, math.pi, 0.0).float()
    opt = torch.optim.AdamW(wf.parameters(), lr=cfg.lr, weight_decay=0.0)
    cross_entropy = phase_loss = float("nan")
    with runtime.progress(total=cfg.steps, desc="warm start", unit="step", enabled=progress) as bar:
        for step in range(cfg.steps):
            if should_stop is not None and should_stop(step):
                return None
            for group in opt.param_groups:
                group["lr"] = warmup_cosine(step, cfg.steps - 1, cfg.lr, 0, cfg.min_lr_ratio)
            log_p, phase = wf(tokens)
            ce = -(weight * log_p).sum()
            pl = phase_mismatch(phase, want, sign_weight)
            opt.zero_grad(set_to_none=True)
            (ce + pl).backward()
            opt.step()
            cross_entropy, phase_loss = ce.item(), pl.item()
            bar.update(1)
    return {"method": target.method, "n_configs": len(target.keys), "steps": cfg.steps,
            "phase_weight": cfg.phase_weight, "cross_entropy": cross_entropy, "phase_loss": phase_loss,
            "overlap": overlap(wf, target), "target_energy": target.energy,
            "target_variational_energy": target.variational_energy}


def phase_mismatch(phase: Tensor, want: Tensor, weight: Tensor) -> Tensor:
    """sum w (1 - cos(phi - want)): zero exactly when every phase is its wanted one (mod 2 pi), smooth everywhere."""
    return (weight * (1 - torch.cos(phase - want))).sum()


@torch.no_grad()
def overlap(wf: Wavefunction, target: TargetState) -> float:
    """|<target|psi>|^2 for the normalised psi (P sums to 1 over the sector, so psi needs no normalising)."""
    log_psi = wf.log_psi(keys_to_tokens(target.keys, wf.n_orb))
    return float(abs((target.coeffs.to(torch.complex128) * torch.exp(log_psi)).sum()) ** 2)


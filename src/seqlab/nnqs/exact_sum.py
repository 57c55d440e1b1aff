"""Exact-sum estimation: the energy and its gradient from psi on the *whole* sector, with no sampling at all.

For sectors small enough for the sector fast path (``VMCConfig.sector_max``) every step already walks the whole
prefix tree to get log psi on every configuration (``sector_log_psi``). Then nothing needs to be sampled:

    E   = <psi|H|psi> / <psi|psi>                       (one sparse product H psi over the whole sector)
    dE  = 2 Re sum_x P(x) (E_loc(x) - E)^* d log psi(x)   (P(x) = |psi(x)|^2 / <psi|psi>, exact weights)

This is NetKet's exact-sum state. Why it matters here: with a capped N_s, a wavefunction that concentrates on
Hartree-Fock (P(HF) > 1 - 1/N_s) draws only HF, E_loc - E = 0 on every sample and the gradient vanishes for good
(N2 collapsed that way in 2 of 3 runs). With exact weights an excited configuration of probability 1e-9 still
carries its share of the gradient, and there is no noise for a schedule to average out.

The energy (and variance) is exact over the whole sector. The gradient is summed over the *gradient set*: the most
probable configurations up to a probability mass of 1 - ``tail`` (and at most ``max_configs`` of them). What is left
out is bounded by its mass: N2's FCI state needs ~1000 configurations for 1 - 2e-7 of its mass (0.004 mHa from FCI
on that support) out of 14 400, and a forward + backward over 1000 configurations costs ~0.2 s, against ~3.5 s for
all 14 400 (docs/nnqs.md, "exact-sum").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seqlab.nnqs.ansatz import Wavefunction
from seqlab.nnqs.local_energy import SectorHamiltonian, SubspaceHamiltonian
from seqlab.nnqs.sampler import enumerate_log_prob
from seqlab.nnqs.space import tokens_to_keys


@dataclass
class ExactSum:
    """One step's exact estimate: the energy over the whole sector and this rank's share of the gradient set."""

    tokens: Tensor  # [K] configurations of this rank's share of the gradient set, [K, n_orb]
    weights: Tensor  # [K] float64, P(x) normalised over the whole sector
    eloc: Tensor  # [K] complex128, exact local energies
    energy: complex  # <psi|H|psi> / <psi|psi>
    variance: float  # <psi|H^2|psi> / <psi|psi> - |E|^2 (zero exactly at an eigenstate)
    n_kept: int  # size of the whole gradient set (all ranks)
    tail_mass: float  # probability left out of the gradient set
    probabilities: Tensor  # [D] float64, P(x) over the whole space (every rank)


@torch.no_grad()
def sector_log_psi(wf: Wavefunction, sector: SectorHamiltonian) -> Tensor:
    """log psi [D] complex128 on every sector configuration, in ``sector.keys`` order.

    log P comes from walking the whole prefix tree on the KV cache (``enumerate_log_prob``), cheaper than one
    parallel forward over the finished configurations because shared prefixes are read once; the phase MLP runs on
    all of them in one batch. Every rank evaluates the whole sector itself (no communication).
    """
    tokens, logp = enumerate_log_prob(wf)
    pos, found = sector.find(tokens_to_keys(tokens))
    assert len(pos) == len(sector) and bool(found.all())
    out = torch.empty(len(sector), dtype=torch.complex128)
    out[pos] = torch.complex(0.5 * logp.double(), wf.phase(tokens).double())
    return out


def gradient_set(prob: Tensor, tail: float, max_configs: int) -> Tensor:
    """Indices of the most probable configurations holding all but ``tail`` of the mass (at most ``max_configs``).

    Sorted by decreasing probability; ties are broken by index (a stable sort), so every rank picks the same set.
    """
    order = torch.sort(prob, descending=True, stable=True).indices
    mass_before = torch.cumsum(prob[order], 0) - prob[order]  # mass of the configurations ranked above each one
    keep = int((mass_before < 1.0 - tail).sum())  # the smallest prefix whose mass reaches 1 - tail
    return order[: max(1, min(keep, max_configs))]


@torch.no_grad()
def exact_sum(wf: Wavefunction, sector: SectorHamiltonian, tail: float, max_configs: int, rank: int = 0,
              world_size: int = 1) -> ExactSum:
    """E, its variance and E_loc on the gradient set from psi on the whole sector (see the module docstring)."""
    return subspace_sum(sector_log_psi(wf, sector), sector, tail, max_configs, rank, world_size)


def subspace_sum(log_psi: Tensor, space: SubspaceHamiltonian, tail: float, max_configs: int, rank: int = 0,
                 world_size: int = 1) -> ExactSum:
    """The exact sum over ``space`` given log psi [D] on all of it: the whole sector, or a selected space.

    Over a selected space S this is the energy of psi restricted to S, <psi_S|H|psi_S> / <psi_S|psi_S>, a variational
    energy in its own right, with its exact gradient. psi is scaled by its largest amplitude before H psi, so nothing
    overflows; amplitudes that underflow to zero are below 1e-300 of the largest and contribute nothing at double
    precision. Every rank computes the same numbers and keeps a strided share of the gradient set for its backward
    (the gradients are all-reduced by the caller).
    """
    psi = torch.exp(log_psi - log_psi.real.max())
    h_psi = torch.complex(torch.from_numpy(space.matrix @ psi.real.numpy()),
                          torch.from_numpy(space.matrix @ psi.imag.numpy()))
    norm = float((psi.abs() ** 2).sum())
    energy = complex((psi.conj() * h_psi).sum()) / norm
    variance = max(float((h_psi.abs() ** 2).sum()) / norm - abs(energy) ** 2, 0.0)
    prob = psi.abs() ** 2 / norm
    kept = gradient_set(prob, tail, max_configs)
    mine = kept[rank::world_size]
    # E_loc row by row, each row scaled by its own psi(x): exact also for configurations far below the largest
    eloc = space.local_energy(space.keys[mine], log_psi)
    return ExactSum(space.tokens[mine], prob[mine], eloc, energy, variance, len(kept),
                    max(0.0, 1.0 - float(prob[kept].sum())), prob)

"""Local energies E_loc(x) = sum_x' H[x, x'] psi(x') / psi(x), the quantity VMC averages instead of a loss.

Two modes:

- ``exact``: psi is evaluated on *every* connected configuration x'. Configurations shared by many samples (the
  usual case: a few hundred connected configurations per sample, heavily overlapping) are evaluated once, through a
  ``PsiTable`` of configurations already evaluated at the current parameters. Unbiased.
- ``sample-space``: the approximation of NNQS-Transformer and NAQS: only x' that are themselves among the sampled
  configurations contribute; the rest count as zero. Much cheaper (no extra network evaluations) but **biased**:
  it truncates H to the sampled subspace, so its energy estimate is not variational and its bias shrinks only as
  the samples cover psi's support.

Values are complex128: log psi = 1/2 log P + i phi, and psi(x')/psi(x) = exp(log psi(x') - log psi(x)).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from seqlab.nnqs.hamiltonian import Hamiltonian

MODES = ("exact", "sample-space")


class PsiTable:
    """log psi at configurations already evaluated with the current parameters, looked up by key (sorted)."""

    def __init__(self, keys: Tensor | None = None, values: Tensor | None = None):
        self.keys = torch.empty(0, dtype=torch.int64)
        self.values = torch.empty(0, dtype=torch.complex128)
        if keys is not None:
            self.add(keys, values)

    def __len__(self) -> int:
        return len(self.keys)

    def lookup(self, keys: Tensor) -> tuple[Tensor, Tensor]:
        """(found [M] bool, values [M] complex128; zero where not found)."""
        if len(self.keys) == 0:
            return torch.zeros(len(keys), dtype=torch.bool), torch.zeros(len(keys), dtype=torch.complex128)
        idx = torch.searchsorted(self.keys, keys).clamp_max(len(self.keys) - 1)
        found = self.keys[idx] == keys
        return found, torch.where(found, self.values[idx], torch.zeros((), dtype=torch.complex128))

    def add(self, keys: Tensor, values: Tensor) -> None:
        keys = torch.cat((self.keys, keys.to(torch.int64)))
        values = torch.cat((self.values, values.to(torch.complex128)))
        keys, order = torch.sort(keys)
        values = values[order]
        keep = torch.ones(len(keys), dtype=torch.bool)
        keep[1:] = keys[1:] != keys[:-1]
        self.keys, self.values = keys[keep], values[keep]


LogPsiFn = Callable[[Tensor], Tensor]  # keys [M] int64 -> log psi [M] complex128


def local_energy(
    ham: Hamiltonian,
    keys: Tensor,
    log_psi: Tensor,
    table: PsiTable,
    evaluate: LogPsiFn | None = None,
    mode: str = "exact",
    max_elements: int = 1 << 21,
) -> Tensor:
    """E_loc for configurations ``keys`` [B] whose log psi [B] is known; returns [B] complex128.

    ``table`` must already hold the samples (sample-space mode uses exactly its contents as "the sampled set");
    in exact mode missing connected configurations are evaluated with ``evaluate`` and added to it. Rows are
    processed in chunks of about ``max_elements`` connected elements to bound memory.
    """
    if mode not in MODES:
        raise ValueError(f"local energy mode {mode!r} unknown; expected one of {MODES}")
    if mode == "exact" and evaluate is None:
        raise ValueError("exact local energies need an `evaluate` function for configurations not yet seen")
    keys = keys.to(torch.int64)
    log_psi = log_psi.to(torch.complex128)
    out = torch.empty(len(keys), dtype=torch.complex128)
    chunk = max(1, max_elements // max(1, ham.n_connected))
    for start in range(0, len(keys), chunk):
        sl = slice(start, start + chunk)
        c = ham.connected(keys[sl])
        found, lp = table.lookup(c.keys)
        if mode == "exact" and not bool(found.all()):
            missing = torch.unique(c.keys[~found])
            table.add(missing, evaluate(missing))
            found, lp = table.lookup(c.keys)
            assert bool(found.all())
        ratio = torch.exp(lp - log_psi[sl][c.row])
        ratio = torch.where(found, ratio, torch.zeros((), dtype=torch.complex128))
        acc = torch.zeros(len(c.diagonal), dtype=torch.complex128)
        acc.index_add_(0, c.row, c.elements.to(torch.complex128) * ratio)
        out[sl] = c.diagonal.to(torch.complex128) + acc
    return out

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

**Sector fast path** (``SectorHamiltonian``; still the *exact* local energy, no approximation). When the whole
particle-number sector (every configuration with the right N_alpha, N_beta) is small — N2 in STO-3G has 14 400 —
H restricted to it is built once per run as a sparse CSR matrix (Slater–Condon, with the same vectorised
``Hamiltonian.connected`` enumeration; at most N_conf x n_connected nonzeros of about 12 bytes each; sizes and
timings in docs/nnqs.md). A step then evaluates log psi on *all* sector configurations without gradients (one walk of the whole prefix
tree on the KV cache, ``sampler.enumerate_log_prob``) and reads E_loc off the sampled rows of H psi. That replaces,
every step, the per-sample enumeration of every single and double excitation, the sorted-key lookups of their keys
and the flat forwards on missing ones by one cached forward of fixed size plus a sparse product over the sampled
rows. It pays off as soon as the samples' neighbourhoods cover a sizeable part of the sector (a few hundred samples
of N2 already do; early VMC steps and the annealing phase sample broadly) and it costs a forward over the whole
sector per step, hence the size threshold (``VMCConfig.sector_max``).
Scaling: each row is divided by its own psi(x) in log space, ratio exp(log psi(x') - log psi(x)), instead of
exponentiating log psi globally: a sampled x has non-negligible probability, so no ratio can overflow, and ratios
that underflow to zero belong to configurations that contribute below round-off.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from seqlab import runtime
from seqlab.nnqs.hamiltonian import Hamiltonian
from seqlab.nnqs.space import all_configurations, find_keys, tokens_to_keys

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
        idx, found = find_keys(self.keys, keys)
        if len(self.keys) == 0:
            return found, torch.zeros(len(keys), dtype=torch.complex128)
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


class SubspaceHamiltonian:
    """H restricted to a set of configurations: ``keys`` [D] (sorted), ``tokens`` [D, n_orb], and ``matrix``, H over
    their positions as a real float64 scipy CSR matrix, diagonal included.

    The whole sector (``SectorHamiltonian``) and the selected space of the selected-sum estimator
    (``selected_space.SelectedSpace``) are both such restrictions; the exact sum reads them the same way.
    """

    def __init__(self, keys: Tensor, tokens: Tensor, matrix):
        self.keys, self.tokens, self.matrix = keys, tokens, matrix

    def __len__(self) -> int:
        return len(self.keys)

    def find(self, keys: Tensor) -> tuple[Tensor, Tensor]:
        """(positions [M] in ``keys``, found [M] bool) of configuration keys."""
        return find_keys(self.keys, keys)

    def local_energy(self, keys: Tensor, log_psi: Tensor, max_elements: int = 1 << 21) -> Tensor:
        """E_loc [B] complex128 at ``keys`` [B], from ``log_psi`` [D] on every configuration of this space.

        E_loc(x) = (H psi)(x) / psi(x) over the sampled rows of H only, each row scaled by its own psi(x):
        sum_x' H[x, x'] exp(log psi(x') - log psi(x)), x' over this space (exact when it is the whole sector).
        """
        pos, found = self.find(keys.to(torch.int64))
        if not bool(found.all()):
            raise ValueError("local_energy: a configuration is outside this space")
        log_psi = log_psi.to(torch.complex128)
        out = torch.empty(len(pos), dtype=torch.complex128)
        chunk = max(1, max_elements * len(self) // max(1, self.matrix.nnz))
        for start in range(0, len(pos), chunk):
            p = pos[start : start + chunk]
            rows = self.matrix[p.numpy()]
            row = torch.from_numpy(np.repeat(np.arange(len(p)), np.diff(rows.indptr)))
            ratio = torch.exp(log_psi[torch.from_numpy(rows.indices).long()] - log_psi[p][row])
            acc = torch.zeros(len(p), dtype=torch.complex128)
            out[start : start + chunk] = acc.index_add_(0, row, torch.from_numpy(rows.data) * ratio)
        return out


class SectorHamiltonian(SubspaceHamiltonian):
    """H restricted to the whole (N_alpha, N_beta) sector, for the exact local energy's sector fast path.

    ``keys`` and ``tokens`` list every configuration of the sector, so E_loc read off it is exact. Built once per
    run (see the module docstring for when that pays), in chunks of about ``max_elements`` connected elements.
    """

    def __init__(self, ham: Hamiltonian, max_elements: int = 1 << 21, progress: bool = True):
        from scipy import sparse  # optional heavy dependency (the nnqs extra), needed only for the sector path

        self.tokens = all_configurations(ham.n_orb, ham.n_alpha, ham.n_beta)
        self.keys = tokens_to_keys(self.tokens)
        D = len(self.keys)
        chunk = max(1, max_elements // max(1, ham.n_connected))
        counts, indices, data = [], [], []
        with runtime.progress(total=D, desc="sector H", unit="conf", delay=2.0, enabled=progress) as bar:
            for start in range(0, D, chunk):
                c = ham.connected(self.keys[start : start + chunk])
                B = len(c.diagonal)
                col, found = self.find(c.keys)
                # excitations conserve N_alpha and N_beta, so the sector is closed under H
                assert bool(found.all()), "a connected configuration left the (N_alpha, N_beta) sector"
                rows = torch.cat((c.row, torch.arange(B)))
                order = torch.argsort(rows, stable=True)  # CSR: rows contiguous (diagonal last in each row)
                counts.append(torch.bincount(rows, minlength=B))
                indices.append(torch.cat((col, torch.arange(start, start + B)))[order].to(torch.int32))
                data.append(torch.cat((c.elements, c.diagonal))[order])
                bar.update(B)
        indptr = torch.cat((torch.zeros(1, dtype=torch.int64), torch.cat(counts).cumsum(0)))
        index_dtype = np.int32 if int(indptr[-1]) < 2**31 else np.int64
        self.matrix = sparse.csr_matrix(
            (torch.cat(data).numpy(), torch.cat(indices).numpy().astype(index_dtype, copy=False),
             indptr.numpy().astype(index_dtype)), shape=(D, D))

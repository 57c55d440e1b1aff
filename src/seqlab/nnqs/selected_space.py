"""The selected space of the selected-sum estimator: the configurations the sampler found, with H among them.

Past the sector fast path (H2O in 6-31G: 1.7 M determinants) the exact sum over the sector is out of reach, and a
Monte Carlo step with a few thousand samples collapses onto Hartree-Fock (docs/nnqs.md). The selected sum keeps
the exact sum's weighting on a smaller set: every configuration the sampler has drawn (N_s large, so everything
above ~1/N_s in probability) is kept in a space S, and a step sums exactly over S with P(x) normalised over S.
That is the energy of psi restricted to S, a variational energy (an upper bound to FCI) with no sampling noise,
and the gradient keeps every configuration of S, however improbable. Why it can work: the FCI state of H2O/6-31G
needs few of the 1.7 M determinants (its 3 000 largest are 1.1 mHa from FCI, its 10 000 largest 0.15 mHa), and
the sampler finds those that the wavefunction weighs; what it weighs outside S is drawn and joins S.

The matrix is built incrementally: a configuration joining S enumerates its connected configurations once
(``Hamiltonian.connected``) and keeps the elements whose other end is in S; H is Hermitian (real here), so that
one enumeration gives both the new row and the new column. Configurations whose probability falls below
``min_prob`` leave S (with their elements), which bounds S by what psi still weighs. What psi weighs too little to
be drawn at all can join through ``expand`` (second-order perturbation theory), pinned against that prune.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from seqlab.nnqs.hamiltonian import Hamiltonian
from seqlab.nnqs.local_energy import SubspaceHamiltonian
from seqlab.nnqs.space import find_keys, keys_to_bits, keys_to_tokens


class SelectedSpace:
    """A growing set of configurations (sorted int64 keys) with the elements of H among them, stored by key pairs."""

    def __init__(self, ham: Hamiltonian, max_elements: int = 1 << 21):
        self.ham, self.max_elements = ham, max_elements
        self.keys = torch.empty(0, dtype=torch.int64)
        self.rows = torch.empty(0, dtype=torch.int64)  # element k is H[rows[k], cols[k]] = values[k], by key
        self.cols = torch.empty(0, dtype=torch.int64)
        self.values = torch.empty(0, dtype=torch.float64)
        self.pinned = torch.empty(0, dtype=torch.int64)  # keys added by ``pin`` (``expand``'s): never pruned by ``keep``
        self.n_expanded = 0  # how many of them ``expand`` added (its cap counts these only)
        self._matrix: SubspaceHamiltonian | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def contains(self, keys: Tensor) -> Tensor:
        """[M] bool: which of ``keys`` are in S."""
        return find_keys(self.keys, keys)[1]

    def add(self, keys: Tensor) -> int:
        """Add configurations (repeats and members are ignored); returns how many joined."""
        new = torch.unique(keys.to(torch.int64))
        new = new[~self.contains(new)]
        if not len(new):
            return 0
        old = self.keys
        joined = torch.sort(torch.cat((old, new))).values
        parts = [(self.rows, self.cols, self.values)]
        chunk = max(1, self.max_elements // max(1, self.ham.n_connected))
        for start in range(0, len(new), chunk):
            x = new[start : start + chunk]
            c = self.ham.connected(x)
            parts.append((x, x, c.diagonal.to(torch.float64)))
            src, dst, h = x[c.row], c.keys, c.elements.to(torch.float64)
            inside = find_keys(joined, dst)[1]
            src, dst, h = src[inside], dst[inside], h[inside]
            parts.append((src, dst, h))  # the new row (both ends new: the other end's row adds the transpose)
            to_old = find_keys(old, dst)[1]
            parts.append((dst[to_old], src[to_old], h[to_old]))  # the new column of the rows already in S
        self.keys = joined
        self.rows, self.cols, self.values = (torch.cat(t) for t in zip(*parts))
        self._matrix = None
        return len(new)

    def pin(self, keys: Tensor) -> int:
        """Add configurations that ``keep`` never prunes; returns how many joined."""
        self.pinned = torch.unique(torch.cat((self.pinned, keys.to(torch.int64))))
        return self.add(keys)

    def keep(self, mask: Tensor) -> int:
        """Keep only the configurations where ``mask`` [len(S)] is true, or which ``pin`` pinned (and their
        elements); returns how many left."""
        mask = mask | find_keys(self.pinned, self.keys)[1]
        gone = int((~mask).sum())
        if gone:
            self.keys = self.keys[mask]
            inside = self.contains(self.rows) & self.contains(self.cols)
            self.rows, self.cols, self.values = self.rows[inside], self.cols[inside], self.values[inside]
            self._matrix = None
        return gone

    def expand(self, keys: Tensor, log_psi: Tensor, energy: float, k: int) -> int:
        """Add (and pin) the ``k`` configurations outside S that matter most to psi by second-order perturbation
        theory, |<x|H|psi>|^2 / |H_xx - E| (Epstein-Nesbet), for psi given by ``log_psi`` on ``keys`` (the space a
        step summed over; S itself may have been pruned since) and ``energy`` its energy there; returns how many
        joined.

        Why: a configuration joins S only once the sampler draws it, so one that psi weighs far too little never
        gets a gradient, and S's own floor (``ground_energy``) stays above FCI however well psi fits S (on
        H2O/6-31G it was most of the error left: docs/nnqs.md). Pinned, the added configurations stay while psi
        learns their amplitudes, whatever their probability.
        """
        if k <= 0 or not len(keys):
            return 0
        psi = torch.exp(log_psi - log_psi.real.max())
        psi = psi / psi.abs().pow(2).sum().sqrt()
        outside = torch.empty(0, dtype=torch.int64)
        h_psi = torch.empty(0, dtype=torch.complex128)  # <x|H|psi_S> for the keys in ``outside``
        chunk = max(1, self.max_elements // max(1, self.ham.n_connected))
        for rows in torch.arange(len(keys)).split(chunk):
            c = self.ham.connected(keys[rows])
            out = ~self.contains(c.keys)
            seen = torch.cat((outside, c.keys[out]))
            contrib = torch.cat((h_psi, c.elements[out] * psi[rows][c.row[out]]))
            outside, at = torch.unique(seen, return_inverse=True)
            h_psi = torch.zeros(len(outside), dtype=torch.complex128).index_add_(0, at, contrib)
        if not len(outside):
            return 0
        diagonal = torch.cat([self.ham.diagonal(keys_to_bits(x, self.ham.n_so)) for x in outside.split(chunk)])
        # -(second-order energy); |H_xx - E| where psi is still far from the ground state and some H_xx lie below E
        gain = h_psi.abs().pow(2) / (diagonal - energy).abs().clamp_min(1e-12)
        new = outside[torch.topk(gain, min(k, len(outside))).indices]
        self.n_expanded += len(new)
        return self.pin(new)

    def state(self) -> dict[str, Tensor]:
        """The space and its elements as tensors, for a checkpoint: a resumed run sums over the same S (rebuilding
        it from the warm-start support would let the first resumed steps see another space)."""
        return {"keys": self.keys, "rows": self.rows, "cols": self.cols, "values": self.values,
                "pinned": self.pinned, "n_expanded": torch.tensor(self.n_expanded)}

    def load_state(self, tensors: dict[str, Tensor]) -> None:
        """Restore what ``state`` returned (a checkpoint's tensors are sha256-verified before they get here; those
        written before ``expand`` existed have no pinned keys, and before ``pin`` only expanded ones)."""
        keys, rows, cols, values = (tensors[name] for name in ("keys", "rows", "cols", "values"))
        pinned = tensors.get("pinned", torch.empty(0, dtype=torch.int64))
        n_expanded = int(tensors.get("n_expanded", torch.tensor(len(pinned))))
        if not (len(rows) == len(cols) == len(values)) or bool((keys[1:] <= keys[:-1]).any()):
            raise ValueError("SelectedSpace.load_state: keys not strictly sorted or element arrays of unequal length")
        if not bool(find_keys(keys, pinned)[1].all()):
            raise ValueError("SelectedSpace.load_state: pinned keys that are not in the space")
        self.keys, self.rows, self.cols, self.values, self.pinned = (
            t.clone() for t in (keys, rows, cols, values, pinned))
        self.n_expanded = n_expanded
        self._matrix = None

    def hamiltonian(self) -> SubspaceHamiltonian:
        """H over S as a ``SubspaceHamiltonian`` (CSR by position in ``keys``), rebuilt only after S changed."""
        if self._matrix is None:
            from scipy import sparse  # optional heavy dependency (the nnqs extra)

            D = len(self.keys)
            r = torch.searchsorted(self.keys, self.rows).numpy()
            c = torch.searchsorted(self.keys, self.cols).numpy()
            matrix = sparse.csr_matrix((self.values.numpy(), (r, c)), shape=(D, D))
            matrix.sum_duplicates()
            self._matrix = SubspaceHamiltonian(self.keys, keys_to_tokens(self.keys, self.ham.n_orb), matrix)
        return self._matrix

    def ground_energy(self) -> float:
        """The lowest eigenvalue of H over S: the best energy any state on S can have (its selected CI), so a run's
        error splits into what psi misses on S and what S misses of the sector (Lanczos: well under a second for 10^4
        keys)."""
        return self.ground_state()[0]

    def ground_state(self) -> tuple[float, np.ndarray]:
        """(lowest eigenvalue, its normalised real eigenvector over ``keys``) of H over S."""
        from scipy.sparse.linalg import eigsh  # optional heavy dependency (the nnqs extra)

        matrix = self.hamiltonian().matrix
        if len(self) <= 2:  # eigsh needs k < D
            values, vectors = np.linalg.eigh(matrix.toarray())
        else:
            values, vectors = eigsh(matrix, k=1, which="SA", v0=np.ones(len(self)))
        return float(values[0]), vectors[:, 0]

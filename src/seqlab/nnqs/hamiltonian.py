"""The electronic Hamiltonian in second quantisation, and its matrix elements between determinants.

    H = E_nuc + sum_pq h_pq a+_p a_q + 1/2 sum_pqrs <pq|rs> a+_p a+_q a_s a_r

over spin orbitals in the interleaved order of ``space.py`` (2i = alpha_i, 2i+1 = beta_i), built from PySCF's
RHF/ROHF molecular orbitals. Matrix elements follow the Slater–Condon rules; the fermionic sign of an excitation is
computed by applying its annihilation and creation operators one at a time to the canonically ordered determinant,
each contributing (-1)^(number of occupied spin orbitals before it). With g[p,q,r,s] = <pq|rs> - <pq|sr>:

    diagonal            E_nuc + sum_i h_ii + 1/2 sum_ij g[i,j,i,j]                 (i, j occupied)
    single  i -> a      sign(a+_a a_i) * (h_ai + sum_j g[a,j,i,j])
    double  i,j -> a,b  sign(a+_a a+_b a_j a_i) * g[a,b,i,j]

``connected`` enumerates, for a whole batch at once, every single and double excitation that conserves N_alpha and
N_beta: since all configurations share the same electron counts, the excitations are one fixed template of
(occupied slot, virtual slot) pairs gathered per row, so there is no Python loop over configurations.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from seqlab.nnqs.space import check_size, keys_to_bits


@dataclass
class Connected:
    """Nonzero off-diagonal elements H[x_row, x'] for a batch, flattened: ``row`` indexes the batch."""

    row: Tensor  # [M] int64
    keys: Tensor  # [M] int64 keys of x'
    elements: Tensor  # [M] float64
    diagonal: Tensor  # [B] float64, H[x, x]


class Hamiltonian:
    """Molecular Hamiltonian with fixed N_alpha, N_beta; all arithmetic in float64."""

    def __init__(self, h1: np.ndarray, eri: np.ndarray, e_nuc: float, n_alpha: int, n_beta: int, eps: float = 1e-12):
        n = h1.shape[0]
        check_size(n)
        if eri.shape != (n, n, n, n):
            raise ValueError(f"eri must be the full (n,n,n,n) chemist-notation tensor, got {eri.shape} for n={n}")
        if not (0 <= n_alpha <= n and 0 <= n_beta <= n):
            raise ValueError(f"N_alpha={n_alpha}, N_beta={n_beta} do not fit into {n} orbitals")
        self.h1, self.eri = np.asarray(h1, dtype=np.float64), np.asarray(eri, dtype=np.float64)
        self.e_nuc, self.n_orb, self.n_so = float(e_nuc), n, 2 * n
        self.n_alpha, self.n_beta = n_alpha, n_beta
        self.eps = eps  # elements below this (zero by point-group symmetry, up to round-off) are dropped

        I2 = np.eye(2)
        h_so = np.kron(self.h1, I2)
        # chemist (pr|qs) over spin orbitals: spatial integral times delta(spin p, spin r) delta(spin q, spin s)
        eri_so = np.einsum("ikjl,st,uv->isktjulv", self.eri, I2, I2).reshape((2 * n,) * 4)
        phys = eri_so.transpose(0, 2, 1, 3)  # <pq|rs> = (pr|qs)
        g = phys - phys.transpose(0, 1, 3, 2)
        N = self.n_so
        self.h_so = torch.from_numpy(np.ascontiguousarray(h_so))
        self.g = torch.from_numpy(np.ascontiguousarray(g))
        self._hdiag = self.h_so.diagonal().clone()
        self._J = torch.einsum("ijij->ij", self.g).contiguous()  # g[i,j,i,j]
        # F[a,i](x) = h[a,i] + sum_j x_j g[a,j,i,j]; one matmul per batch via this [N*N, N] table
        self._Gs = torch.einsum("ajij->aij", self.g).reshape(N * N, N).contiguous()
        self._gflat = self.g.reshape(-1)

    # --- excitation templates ------------------------------------------------------------------------------
    @cached_property
    def _templates(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Slots into the per-row [alpha occ | beta occ] and [alpha vir | beta vir] lists of every excitation."""
        n, na, nb = self.n_orb, self.n_alpha, self.n_beta
        va, vb = n - na, n - nb
        oa, ob = range(na), range(na, na + nb)
        ua, ub = range(va), range(va, va + vb)
        singles = [(p, q) for p in oa for q in ua] + [(p, q) for p in ob for q in ub]
        doubles = (
            [(p1, p2, q1, q2) for p1, p2 in itertools.combinations(oa, 2) for q1, q2 in itertools.combinations(ua, 2)]
            + [(p1, p2, q1, q2) for p1, p2 in itertools.combinations(ob, 2) for q1, q2 in itertools.combinations(ub, 2)]
            + [(p1, p2, q1, q2) for p1 in oa for p2 in ob for q1 in ua for q2 in ub]
        )
        s = torch.tensor(singles, dtype=torch.int64).reshape(-1, 2)
        d = torch.tensor(doubles, dtype=torch.int64).reshape(-1, 4)
        return s[:, 0], s[:, 1], d[:, :2], d[:, 2:]

    @property
    def n_connected(self) -> int:
        """Number of single + double excitations of any configuration (before dropping zero elements)."""
        s_occ, _, d_occ, _ = self._templates
        return len(s_occ) + len(d_occ)

    def _occ_vir(self, bits: Tensor) -> tuple[Tensor, Tensor]:
        na, nb = self.n_alpha, self.n_beta
        a, b = bits[:, 0::2], bits[:, 1::2]
        # stable sort on "is empty": occupied orbitals first, each group in ascending orbital order
        ia = torch.sort((~a).to(torch.int8), dim=1, stable=True).indices
        ib = torch.sort((~b).to(torch.int8), dim=1, stable=True).indices
        occ = torch.cat((2 * ia[:, :na], 2 * ib[:, :nb] + 1), dim=1)
        vir = torch.cat((2 * ia[:, na:], 2 * ib[:, nb:] + 1), dim=1)
        return occ, vir

    # --- matrix elements -----------------------------------------------------------------------------------
    def diagonal(self, bits: Tensor) -> Tensor:
        x = bits.to(torch.float64)
        return self.e_nuc + x @ self._hdiag + 0.5 * ((x @ self._J) * x).sum(-1)

    def connected(self, keys: Tensor) -> Connected:
        """All nonzero H[x, x'] (x' != x) for a batch of configuration keys, plus the diagonal."""
        keys = keys.to(torch.int64)
        bits = keys_to_bits(keys, self.n_so)
        B, N = bits.shape
        x = bits.to(torch.float64)
        before = (torch.cumsum(bits.to(torch.int64), 1) - bits.to(torch.int64))  # occupied strictly before p
        occ, vir = self._occ_vir(bits)
        s_occ, s_vir, d_occ, d_vir = self._templates
        one = torch.ones((), dtype=torch.int64)

        # singles i -> a: sign of a+_a a_i is (-1)^(P(i) + P(a) - [i < a])
        I, A = occ[:, s_occ], vir[:, s_vir]
        par = before.gather(1, I) + before.gather(1, A) - (I < A).long()
        F = (self.h_so.reshape(-1)[None, :] + x @ self._Gs.T)  # [B, N*N], F[a*N + i]
        el_s = F.gather(1, A * N + I) * (1 - 2 * (par & 1)).double()
        k_s = keys[:, None] ^ (one << I) ^ (one << A)

        # doubles i,j -> a,b as a+_a a+_b a_j a_i, sign accumulated operator by operator
        I, J = occ[:, d_occ[:, 0]], occ[:, d_occ[:, 1]]
        A, Bv = vir[:, d_vir[:, 0]], vir[:, d_vir[:, 1]]
        lt = lambda u, v: (u < v).long()  # noqa: E731
        par = (
            before.gather(1, I)
            + before.gather(1, J) - lt(I, J)
            + before.gather(1, Bv) - lt(I, Bv) - lt(J, Bv)
            + before.gather(1, A) - lt(I, A) - lt(J, A) + lt(Bv, A)
        )
        el_d = self._gflat[((A * N + Bv) * N + I) * N + J] * (1 - 2 * (par & 1)).double()
        k_d = keys[:, None] ^ (one << I) ^ (one << J) ^ (one << A) ^ (one << Bv)

        el = torch.cat((el_s, el_d), 1)
        kk = torch.cat((k_s, k_d), 1)
        keep = el.abs() > self.eps
        row = torch.arange(B, dtype=torch.int64)[:, None].expand_as(el)[keep]
        return Connected(row=row, keys=kk[keep], elements=el[keep], diagonal=self.diagonal(bits))

    def dense(self, keys: Tensor) -> np.ndarray:
        """Dense H over the given sorted keys (which must be closed under excitations, e.g. the full space)."""
        keys = keys.to(torch.int64)
        if not bool((keys[1:] > keys[:-1]).all()):
            raise ValueError("dense() needs strictly increasing keys")
        c = self.connected(keys)
        col = torch.searchsorted(keys, c.keys)
        if bool((col >= len(keys)).any()) or bool((keys[col.clamp_max(len(keys) - 1)] != c.keys).any()):
            raise ValueError("the key set is not closed under single/double excitations")
        H = torch.zeros(len(keys), len(keys), dtype=torch.float64)
        H[c.row, col] = c.elements
        H[torch.arange(len(keys)), torch.arange(len(keys))] = c.diagonal
        return H.numpy()


def mo_integrals(mf) -> tuple[np.ndarray, np.ndarray, float]:
    """(h1, eri, e_nuc) in the MO basis of a converged PySCF RHF/ROHF: h1 [n,n], eri [n,n,n,n] as (pq|rs)."""
    from pyscf import ao2mo  # optional heavy dependency (the nnqs extra)

    C = mf.mo_coeff
    if isinstance(C, tuple) or np.ndim(C) != 2:
        raise ValueError("seqlab.nnqs needs restricted orbitals (RHF/ROHF); got unrestricted mo_coeff")
    h1 = C.T @ mf.get_hcore() @ C
    n = C.shape[1]
    eri = ao2mo.restore(1, ao2mo.kernel(mf.mol, C), n)
    return h1, np.asarray(eri), float(mf.energy_nuc())

"""The configuration space: pair tokens, spin-orbital bits and integer keys, and how they map onto each other.

Orbital ordering (fixed, used everywhere in seqlab.nnqs): spatial orbital ``i`` owns spin orbitals
``2*i`` (alpha) and ``2*i + 1`` (beta). A determinant is the canonically ordered product of creation operators
``a+_{p1} a+_{p2} ... |0>`` with ``p1 < p2 < ...`` in that interleaved order; every fermionic sign in
``hamiltonian.py`` is relative to it.

A **pair token** describes one spatial orbital: ``t = n_alpha + 2 * n_beta`` so 0 = empty, 1 = up (alpha),
2 = down (beta), 3 = doubly occupied. A configuration is a sequence of ``n_orb`` pair tokens, i.e. a "sentence" the
autoregressive ansatz reads and writes left to right. Because of the interleaving, the integer
``key = sum_i t_i * 4**i`` equals ``sum_p bit_p * 2**p`` over spin orbitals, so one int64 serves as a hash key for
deduplication *and* as a bit string for excitations (``key - 2**i + 2**a`` is the single excitation i -> a).
That limits the key to 62 spin orbitals (31 spatial), far beyond what exact references can check anyway.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

EMPTY, UP, DOWN, DOUBLE = 0, 1, 2, 3
N_PAIR_TOKENS = 4
MAX_SPIN_ORBITALS = 62  # int64 keys; bit 63 is the sign bit


def check_size(n_orb: int) -> None:
    if 2 * n_orb > MAX_SPIN_ORBITALS:
        raise ValueError(
            f"{n_orb} spatial orbitals ({2 * n_orb} spin orbitals) exceed seqlab.nnqs's limit of "
            f"{MAX_SPIN_ORBITALS} spin orbitals (configurations are int64 bit keys); use a smaller basis"
        )


def tokens_to_bits(tokens: Tensor) -> Tensor:
    """[B, n_orb] pair tokens -> [B, 2*n_orb] bool occupations in the interleaved (alpha_i, beta_i) order."""
    t = tokens.long()
    return torch.stack(((t & 1).bool(), (t >> 1).bool()), dim=-1).flatten(-2)


def tokens_to_keys(tokens: Tensor) -> Tensor:
    """[B, n_orb] pair tokens -> [B] int64 keys (base-4 number, orbital 0 least significant)."""
    n_orb = tokens.shape[-1]
    check_size(n_orb)
    weights = 4 ** torch.arange(n_orb, dtype=torch.int64, device=tokens.device)
    return (tokens.long() * weights).sum(-1)


def keys_to_tokens(keys: Tensor, n_orb: int) -> Tensor:
    shifts = 2 * torch.arange(n_orb, dtype=torch.int64, device=keys.device)
    return (keys[:, None] >> shifts) & 3


def find_keys(sorted_keys: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
    """(positions [M] in ``sorted_keys``, found [M] bool) of ``keys``; positions are valid indices where found."""
    if not len(sorted_keys):
        return torch.zeros(len(keys), dtype=torch.int64), torch.zeros(len(keys), dtype=torch.bool)
    pos = torch.searchsorted(sorted_keys, keys).clamp_max(len(sorted_keys) - 1)
    return pos, sorted_keys[pos] == keys


def keys_to_bits(keys: Tensor, n_so: int) -> Tensor:
    shifts = torch.arange(n_so, dtype=torch.int64, device=keys.device)
    return ((keys[:, None] >> shifts) & 1).bool()


def n_configurations(n_orb: int, n_alpha: int, n_beta: int) -> int:
    """Size of the determinant space with fixed N_alpha and N_beta."""
    return math.comb(n_orb, n_alpha) * math.comb(n_orb, n_beta)


def all_configurations(n_orb: int, n_alpha: int, n_beta: int) -> Tensor:
    """Every valid configuration as [D, n_orb] pair tokens, sorted by key (so ``searchsorted`` finds them)."""
    check_size(n_orb)

    def strings(n: int) -> Tensor:
        rows = [sum(1 << i for i in occ) for occ in itertools.combinations(range(n_orb), n)]
        return torch.tensor(rows, dtype=torch.int64)

    a, b = strings(n_alpha), strings(n_beta)
    shifts = torch.arange(n_orb, dtype=torch.int64)
    abits = (a[:, None] >> shifts) & 1  # [Da, n_orb]
    bbits = (b[:, None] >> shifts) & 1
    tokens = (abits[:, None, :] + 2 * bbits[None, :, :]).reshape(-1, n_orb)
    keys = tokens_to_keys(tokens)
    return tokens[torch.argsort(keys)]


def valid_token_mask(alpha_left: Tensor, beta_left: Tensor, orbitals_left: Tensor | int) -> Tensor:
    """Remaining electrons [...] and orbitals still to fill (this one included, broadcastable) -> [..., 4] bool.

    A token is valid when it takes no more electrons of a spin than remain, and leaves no more electrons of a spin
    than the ``orbitals_left - 1`` later orbitals can hold. Masking with this before the softmax makes every
    sample conserve N_alpha and N_beta, so no probability is wasted on unphysical configurations.
    """
    tok = torch.arange(N_PAIR_TOKENS, device=alpha_left.device)
    ra, rb = alpha_left[..., None] - (tok & 1), beta_left[..., None] - (tok >> 1)
    later = torch.as_tensor(orbitals_left, device=alpha_left.device)[..., None] - 1
    return (ra >= 0) & (rb >= 0) & (ra <= later) & (rb <= later)

"""Weight-only quantisation schemes: int8 (symmetric, per output channel or per group) and int4 (asymmetric groups).

Why these two: decode speed on a CPU is bytes per weight, and these are the two widths our kernel reads
(:mod:`seqlab.quant.kernels`). int4 keeps a scale *and* a minimum per group (``w = q * scale + min``) because
that is exactly llama.cpp's Q4_1 block, and Q4_0 (``w = (q - 8) * d``) is the special case ``min = -8 d``, so
GGUF blocks map onto it without re-quantisation. int8 is ``w = q * scale``, which is Q8_0 at group 32.

The int4 nibbles are stored in llama.cpp's order: per row and 32-element sub-block, 16 bytes where byte ``j``
holds element ``j`` (low nibble) and element ``j + 16`` (high nibble).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

INT4_GROUP_SIZES = (32, 64, 128)
INT8_GROUP_SIZES = (0, 32, 64, 128)  # 0: one scale per output channel
SUB_BLOCK = 32


@dataclass(frozen=True)
class Scheme:
    """``bits`` 8 or 4; ``group_size`` elements along ``in_features`` share a scale (0 = the whole row, int8)."""

    bits: int
    group_size: int

    def check(self, in_features: int, layer: str = "layer") -> None:
        """Raise ValueError naming ``layer`` when this scheme cannot quantise a layer with ``in_features`` inputs."""
        if self.bits not in (4, 8):
            raise ValueError(f"{layer}: unsupported bit width {self.bits} (supported: 8, 4)")
        allowed = INT4_GROUP_SIZES if self.bits == 4 else INT8_GROUP_SIZES
        if self.group_size not in allowed:
            raise ValueError(f"{layer}: unsupported group size {self.group_size} for int{self.bits} "
                             f"(supported: {', '.join(map(str, allowed))}{'; 0 = per channel' if self.bits == 8 else ''})")
        if in_features % 8:  # the kernels read a row 8 values at a time
            raise ValueError(f"{layer}: int{self.bits} needs in_features to be a multiple of 8, got {in_features}")
        group = self.group_size or in_features
        if in_features % group or (self.bits == 4 and in_features % SUB_BLOCK):
            fits = [g for g in allowed if g and g < group and in_features % g == 0
                    and (self.bits == 8 or in_features % SUB_BLOCK == 0)]
            raise ValueError(f"{layer}: group size {group} does not divide in_features={in_features}"
                             + (f"; a group size that divides it: {fits[-1]}" if fits else ""))

    def groups(self, in_features: int) -> int:
        return in_features // (self.group_size or in_features)


def pack_int4(q: Tensor) -> Tensor:
    """``[N, K]`` values 0..15 -> ``[N, K/2]`` uint8 in llama.cpp's Q4 nibble order."""
    n, k = q.shape
    q = q.to(torch.uint8).reshape(n, k // SUB_BLOCK, 2, SUB_BLOCK // 2)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_int4`: ``[N, K/2]`` uint8 -> ``[N, K]`` uint8 values 0..15."""
    n, half = packed.shape
    b = packed.reshape(n, half // (SUB_BLOCK // 2), 1, SUB_BLOCK // 2)
    return torch.cat([b & 0x0F, b >> 4], dim=2).reshape(n, half * 2)


def quantize_weight(w: Tensor, scheme: Scheme, name: str = "weight") -> dict[str, Tensor]:
    """fp weight ``[N, K]`` -> ``{"qweight", "scales"[, "mins"]}`` (fp32 scales, one per row and group).

    Round to nearest: every element is off by at most half its group's step (``scale / 2``). A NaN or inf, or a
    group whose range overflows fp32, is refused naming ``name``: it would make its whole group NaN.
    """
    w = w.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name}: the weight holds NaN or inf; there is nothing to quantise it to")
    n, k = w.shape
    g = scheme.group_size or k
    wg = w.reshape(n, k // g, g)
    if scheme.bits == 8:
        scales = wg.abs().amax(dim=2) / 127.0
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(wg / safe[..., None]).clamp_(-127, 127).to(torch.int8).reshape(n, k)
        return {"qweight": q.contiguous(), "scales": scales.contiguous()}
    lo, hi = wg.amin(dim=2), wg.amax(dim=2)
    scales = (hi - lo) / 15.0
    if not bool(torch.isfinite(scales).all()):
        raise ValueError(f"{name}: a group's range (max - min) overflows fp32; int4 cannot hold it")
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((wg - lo[..., None]) / safe[..., None]).clamp_(0, 15).reshape(n, k)
    return {"qweight": pack_int4(q).contiguous(), "scales": scales.contiguous(), "mins": lo.contiguous()}


def dequantize_weight(qweight: Tensor, scales: Tensor, mins: Tensor | None, bits: int, group_size: int,
                      rows: slice | None = None) -> Tensor:
    """The fp32 weight a quantised one stands for (``rows`` selects output rows, for blockwise use).

    Computed as ``q * scale`` then ``+ min``, two roundings in that order, which is exactly how the GGUF reference
    dequantises Q4_1 / Q8_0, so mapped GGUF weights come back bit for bit.
    """
    if rows is not None:
        qweight, scales = qweight[rows], scales[rows]
        mins = None if mins is None else mins[rows]
    n = qweight.shape[0]
    q = unpack_int4(qweight) if bits == 4 else qweight
    k = q.shape[1]
    g = group_size or k
    w = q.reshape(n, k // g, g).float() * scales[..., None]
    if mins is not None:
        w = w + mins[..., None]
    return w.reshape(n, k)

"""Quantise -> dequantise error stays within half a quantisation step, for every scheme."""
from __future__ import annotations

import pytest
import torch

from seqlab.quant import QuantLinear, Scheme, dequantize_weight, quantize_weight
from seqlab.quant.schemes import pack_int4, unpack_int4

SCHEMES = [Scheme(8, 0), Scheme(8, 32), Scheme(8, 128), Scheme(4, 32), Scheme(4, 64), Scheme(4, 128)]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"int{s.bits}-g{s.group_size}")
def test_round_trip_error_within_half_a_step(scheme):
    torch.manual_seed(1)
    w = torch.randn(48, 256) * torch.logspace(-3, 0, 48)[:, None]  # rows of very different magnitude
    parts = quantize_weight(w, scheme)
    back = dequantize_weight(parts["qweight"], parts["scales"], parts.get("mins"), scheme.bits, scheme.group_size)
    g = scheme.group_size or w.shape[1]
    step = parts["scales"].repeat_interleave(g, dim=1)
    err = (back - w).abs()
    # half a step, plus fp32 rounding of q * scale (+ min) relative to the group's largest magnitude
    slack = 4e-7 * w.abs().reshape(48, -1, g).amax(2).repeat_interleave(g, dim=1)
    assert bool((err <= step / 2 + slack).all()), float((err - step / 2).max())
    levels = 255 if scheme.bits == 8 else 16  # int8 symmetric -127..127, int4 0..15
    assert step.max() <= 2 * w.abs().max() / (levels - 1) * (1 + 1e-6)


def test_int4_pack_order_is_llamacpp():
    q = torch.arange(32).remainder(16).reshape(1, 32)
    packed = pack_int4(q)
    assert packed.shape == (1, 16)
    assert [int(b) & 15 for b in packed[0]] == list(range(16))  # low nibbles: elements 0..15
    assert [int(b) >> 4 for b in packed[0]] == [i % 16 for i in range(16, 32)]  # high nibbles: elements 16..31
    assert torch.equal(unpack_int4(packed), q.to(torch.uint8))


def test_constant_group_is_exact():
    w = torch.full((4, 64), 0.25)
    parts = quantize_weight(w, Scheme(4, 32))
    assert torch.equal(dequantize_weight(parts["qweight"], parts["scales"], parts["mins"], 4, 32), w)


@pytest.mark.parametrize("bits,group,in_features,needle", [
    (3, 32, 64, "unsupported bit width 3"),
    (4, 48, 96, "unsupported group size 48"),
    (4, 0, 64, "unsupported group size 0"),
    (4, 128, 192, "group size 128 does not divide in_features=192"),
    (8, 64, 96, "group size 64 does not divide in_features=96"),
])
def test_bad_schemes_name_the_layer(bits, group, in_features, needle):
    with pytest.raises(ValueError, match="blocks.3.mlp.down") as e:
        QuantLinear.from_weight(torch.randn(8, in_features), Scheme(bits, group), name="blocks.3.mlp.down")
    assert needle in str(e.value)


def test_refusals_say_what_is_wrong():
    """An int8 row of 100 was refused as "group size 100 does not divide in_features=100"; NaN, inf and a group
    whose range overflows fp32 quantised silently into NaN groups."""
    with pytest.raises(ValueError, match=r"^qkv: int8 needs in_features to be a multiple of 8, got 100$"):
        Scheme(8, 0).check(100, "qkv")
    with pytest.raises(ValueError, match=r"^up: group size 64 does not divide in_features=96; a group size that "
                                         r"divides it: 32$"):
        Scheme(8, 64).check(96, "up")
    for bad in (float("nan"), float("inf")):
        w = torch.randn(4, 64)
        w[1, 3] = bad
        for bits in (8, 4):
            with pytest.raises(ValueError, match=r"^down: the weight holds NaN or inf"):
                quantize_weight(w, Scheme(bits, 32), "down")
    wide = torch.zeros(2, 32)
    wide[0, 0], wide[0, 1] = 3e38, -3e38
    with pytest.raises(ValueError, match="overflows fp32"):
        quantize_weight(wide, Scheme(4, 32))

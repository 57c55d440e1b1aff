"""Causality and padding invariance of the core, on random weights."""

import pytest
import torch

from seqlab import build_model

from .helpers import BART, BERT, DECODERS, T5ISH, cfg


@pytest.mark.parametrize("name", list(DECODERS))
def test_decoder_is_causal(name):
    model = build_model(cfg(DECODERS[name])).eval()
    T = 12
    ids = torch.randint(0, 97, (1, T))
    base = model(ids)
    for j in range(1, T):
        changed = ids.clone()
        changed[0, j:] = (changed[0, j:] + 1 + torch.randint(0, 90, (T - j,))) % 97
        out = model(changed)
        # positions < j only see tokens < j, so they must not move
        assert (out[0, :j] - base[0, :j]).abs().max() < 1e-6
        assert (out[0, j:] - base[0, j:]).abs().max() > 1e-4


def test_encoder_sees_the_future():
    model = build_model(cfg(BERT)).eval()
    ids = torch.randint(0, 97, (1, 10))
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 97
    assert (model(ids)[0, 0] - model(changed)[0, 0]).abs().max() > 1e-4


def _pad(ids: torch.Tensor, n: int, side: str, pad_id: int = 0):
    pad = torch.full((1, n), pad_id, dtype=ids.dtype)
    ones, zeros = torch.ones_like(ids), torch.zeros(1, n, dtype=torch.long)
    if side == "left":
        return torch.cat([pad, ids], 1), torch.cat([zeros, ones], 1)
    return torch.cat([ids, pad], 1), torch.cat([ones, zeros], 1)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", [*DECODERS, "bert"])
def test_padding_does_not_change_real_positions(name, side):
    base = BERT if name == "bert" else DECODERS[name]
    model = build_model(cfg(base)).eval()
    short = torch.randint(1, 97, (1, 7))
    longer = torch.randint(1, 97, (1, 11))
    padded, mask = _pad(short, 4, side)
    batch = torch.cat([padded, longer])
    batch_mask = torch.cat([mask, torch.ones_like(longer)])
    out = model(batch, attention_mask=batch_mask)
    assert torch.isfinite(out).all()
    real = mask[0].bool()
    assert (out[0, real] - model(short)[0]).abs().max() < 1e-5
    assert (out[1] - model(longer)[0]).abs().max() < 1e-5


@pytest.mark.parametrize("base", [BART, T5ISH], ids=["bart", "rope_gqa"])
def test_encoder_decoder_padding(base):
    model = build_model(cfg(base)).eval()
    src, dec = torch.randint(1, 97, (1, 6)), torch.randint(1, 97, (1, 5))
    src_p, src_m = _pad(src, 3, "right")
    dec_p, dec_m = _pad(dec, 2, "right")
    src_b = torch.cat([src_p, torch.randint(1, 97, (1, 9))])
    dec_b = torch.cat([dec_p, torch.randint(1, 97, (1, 7))])
    out = model(src_b, torch.cat([src_m, torch.ones(1, 9, dtype=torch.long)]), decoder_input_ids=dec_b,
                decoder_attention_mask=torch.cat([dec_m, torch.ones(1, 7, dtype=torch.long)]))
    assert torch.isfinite(out).all()
    ref = model(src, decoder_input_ids=dec)
    assert (out[0, :5] - ref[0]).abs().max() < 1e-5


def test_all_padding_row_is_finite():
    model = build_model(cfg(DECODERS["llama"])).eval()
    ids = torch.randint(0, 97, (2, 5))
    mask = torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.isfinite(model(ids, attention_mask=mask)).all()

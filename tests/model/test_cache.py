"""The KV cache is exact: prefill + decode equals one full forward pass."""

import pytest
import torch

from seqlab import build_model
from seqlab.model import CacheOverflowError

from .helpers import BART, DECODERS, T5ISH, cfg

TOL = 1e-5


def _decode_all(model, ids, prefix: int, mask=None, chunk: int | None = None):
    """Prefill ``prefix`` tokens (optionally in chunks), then feed the rest one token at a time."""
    cache = model.new_cache(ids.shape[0], 64)
    outs = []
    chunk = chunk or prefix
    for s in range(0, prefix, chunk):
        e = min(prefix, s + chunk)
        outs.append(model(ids[:, s:e], attention_mask=None if mask is None else mask[:, s:e], cache=cache))
    for t in range(prefix, ids.shape[1]):
        outs.append(model(ids[:, t : t + 1], cache=cache))
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("chunk", [None, 3])
def test_prefill_then_decode_equals_full_forward(name, chunk):
    model = build_model(cfg(DECODERS[name])).eval()
    ids = torch.randint(0, 97, (2, 14))
    full = model(ids)
    stepped, cache = _decode_all(model, ids, prefix=8, chunk=chunk)
    assert (stepped - full).abs().max() < TOL
    assert cache.lengths().tolist() == [14, 14]


def test_left_padded_batch_on_cache():
    model = build_model(cfg(DECODERS["llama"])).eval()
    a, b = torch.randint(1, 97, (1, 5)), torch.randint(1, 97, (1, 8))
    ids = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), a], 1), b])
    mask = torch.tensor([[0] * 3 + [1] * 5, [1] * 8])
    cache = model.new_cache(2, 32)
    model(ids, attention_mask=mask, cache=cache)
    nxt = torch.randint(1, 97, (2, 3))
    steps = torch.cat([model(nxt[:, i : i + 1], cache=cache) for i in range(3)], 1)
    ref_a = model(torch.cat([a, nxt[:1]], 1))[:, -3:]
    ref_b = model(torch.cat([b, nxt[1:]], 1))[:, -3:]
    assert (steps[0] - ref_a[0]).abs().max() < TOL
    assert (steps[1] - ref_b[0]).abs().max() < TOL
    assert cache.lengths().tolist() == [8, 11]


@pytest.mark.parametrize("base", [BART, T5ISH], ids=["bart_learned", "rope_gqa"])
def test_encoder_decoder_cache(base):
    model = build_model(cfg(base)).eval()
    src = torch.randint(1, 97, (2, 9))
    src_mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    dec = torch.randint(1, 97, (2, 7))
    full = model(src, src_mask, decoder_input_ids=dec)
    memory = model.encode(src, src_mask)
    cache = model.new_cache(2, 32)
    outs = [model.decode(dec[:, :3], memory, src_mask, cache=cache)]
    k_first = cache.cross_k[0]
    outs += [model.decode(dec[:, t : t + 1], None, None, cache=cache) for t in range(3, 7)]
    assert cache.cross_k[0] is k_first  # cross-attention K/V computed once
    assert (torch.cat(outs, 1) - full).abs().max() < TOL


def test_crop_rolls_back_exactly():
    model = build_model(cfg(DECODERS["llama"])).eval()
    ids = torch.randint(0, 97, (1, 10))
    cache = model.new_cache(1, 32)
    model(ids[:, :6], cache=cache)
    model(torch.randint(0, 97, (1, 3)), cache=cache)  # tokens that get rejected
    cache.crop(6)
    out = torch.cat([model(ids[:, t : t + 1], cache=cache) for t in range(6, 10)], 1)
    assert (out - model(ids)[:, 6:]).abs().max() < TOL


def test_per_row_crop_leaves_harmless_holes():
    model = build_model(cfg(DECODERS["llama"])).eval()
    ids = torch.randint(0, 97, (2, 10))
    cache = model.new_cache(2, 32)
    model(ids[:, :5], cache=cache)
    junk = torch.randint(0, 97, (2, 3))
    model(junk, cache=cache)
    cache.crop(torch.tensor([5, 7]))  # row 0 rejects all three, row 1 keeps two
    out = model(ids[:, 5:6], cache=cache)
    ref0 = model(ids[:1, :6])[:, -1]
    ref1 = model(torch.cat([ids[1:, :5], junk[1:, :2], ids[1:, 5:6]], 1))[:, -1]
    assert (out[0, -1] - ref0[0]).abs().max() < TOL
    assert (out[1, -1] - ref1[0]).abs().max() < TOL
    for bad in ([5, cache.pos + 1], [-1, 6]):  # past the filled slots (unfilled memory), or before the first: refused
        with pytest.raises(ValueError, match="outside the filled range"):
            cache.crop(torch.tensor(bad))


def test_reorder_selects_rows():
    model = build_model(cfg(DECODERS["gpt2"])).eval()
    ids = torch.randint(0, 97, (3, 6))
    cache = model.new_cache(3, 16)
    model(ids[:, :5], cache=cache)
    idx = torch.tensor([2, 2, 0])
    cache.reorder(idx)
    out = model(ids[idx, 5:6], cache=cache)
    assert (out[:, -1] - model(ids[idx])[:, -1]).abs().max() < TOL


def test_overflow_raises_and_nbytes():
    model = build_model(cfg(DECODERS["llama"])).eval()
    cache = model.new_cache(2, 8)
    c = model.config
    assert cache.nbytes == 2 * c.n_layers * 2 * c.n_kv_heads * 8 * c.head_dim * 4 + 2 * 8
    model(torch.randint(0, 97, (2, 6)), cache=cache)
    with pytest.raises(CacheOverflowError, match="holds 8 positions"):
        model(torch.randint(0, 97, (2, 3)), cache=cache)


def test_select_leaves_the_parent_untouched():
    model = build_model(cfg(DECODERS["llama"])).eval()
    ids = torch.randint(0, 97, (2, 6))
    parent = model.new_cache(2, 16)
    for t in (*parent.k, *parent.v):  # slots past ``pos`` are unfilled memory: zeros here, so all compare
        t.zero_()
    model(ids[:, :5], cache=parent)
    before = parent.k[0].clone()
    child = parent.select(torch.tensor([1, 1, 0]))
    out = model(ids[[1, 1, 0], 5:6], cache=child)
    assert child.batch_size == 3 and parent.batch_size == 2 and parent.pos == 5
    assert torch.equal(parent.k[0], before)
    assert (out[:, -1] - model(ids[[1, 1, 0]])[:, -1]).abs().max() < TOL


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_keeping_one_position_per_row_changes_neither_its_state_nor_the_cache(name):
    """``body(keep=...)`` runs the last layer on one position per row: that row's hidden state, and every cache
    entry, equal the full pass's; on an empty cache, padded rows, and a second chunk on a filled cache."""
    model = build_model(cfg(DECODERS[name])).eval()
    ids = torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(1))
    rows = torch.arange(3)
    keep = torch.tensor([8, 3, 0])  # the last position, and earlier ones (their causal mask rows are built)
    with torch.no_grad():
        assert (model.body(ids, keep=keep)[:, 0] - model.body(ids)[rows, keep]).abs().max() < TOL
        mask = torch.ones(3, 9, dtype=torch.long)
        mask[1, 5:], mask[2, 2:] = 0, 0  # right padding: each row's last real token
        last = mask.sum(1) - 1
        full_cache, kept_cache = model.new_cache(3, 32), model.new_cache(3, 32)
        full = model.body(ids, mask, cache=full_cache)[rows, last]
        kept = model.body(ids, mask, cache=kept_cache, keep=last)
        assert kept.shape == (3, 1, 64) and (kept[:, 0] - full).abs().max() < TOL
        n = full_cache.pos
        for layer in range(model.config.n_layers):  # the slots written (the rest is unfilled memory)
            assert torch.equal(kept_cache.k[layer][:, :, :n], full_cache.k[layer][:, :, :n])
            assert torch.equal(kept_cache.v[layer][:, :, :n], full_cache.v[layer][:, :, :n])
        more = torch.randint(0, 97, (3, 4), generator=torch.Generator().manual_seed(2))
        full = model.body(more, cache=full_cache)[:, -1]
        kept = model.body(more, cache=kept_cache, keep=torch.full((3,), 3))[:, 0]
        assert (kept - full).abs().max() < TOL

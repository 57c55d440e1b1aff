"""SlotKVCache: rows at different fill levels decode exactly as each row would alone on a plain KVCache."""

from __future__ import annotations

import pytest
import torch

from seqlab.generate.engine import decode_step, prefill
from seqlab.model.cache import KVCache
from seqlab.model.slot_cache import SlotKVCache
from tests.generate.gen_helpers import tiny_decoder


def _slots_for(model, n_slots: int, max_len: int) -> SlotKVCache:
    cfg = model.config
    return SlotKVCache(cfg.n_layers, n_slots, cfg.n_kv_heads, cfg.head_dim, max_len, dtype=torch.float64)


@torch.no_grad()
def test_rows_at_different_lengths_decode_like_each_row_alone():
    model = tiny_decoder().double()
    prompts = [[5, 7, 9], [1, 2, 3, 4, 5, 6, 7, 8], [11]]
    slots = _slots_for(model, 4, 32)
    alone = []
    for p in prompts:
        own = model.new_cache(1, 32, dtype=torch.float64)
        prefill(model, torch.tensor([p]), own)
        slots.load_row(slots.claim_row(), own, len(p))
        alone.append(own)
    assert not slots.dense and slots.pos == 8 and slots.batch_size == 3
    tokens = torch.tensor([3, 4, 5])
    for _ in range(3):
        batched = decode_step(model, tokens, slots, position_ids=slots.positions())
        for i, own in enumerate(alone):
            single = decode_step(model, tokens[i : i + 1], own)
            torch.testing.assert_close(batched[i : i + 1], single, rtol=1e-10, atol=1e-10)
        tokens = batched.argmax(-1)
    assert [slots.fill_of(i) for i in range(3)] == [6, 11, 4]


@torch.no_grad()
def test_release_moves_the_last_row_into_the_hole():
    model = tiny_decoder().double()
    slots = _slots_for(model, 3, 16)
    own = []
    for p in ([1, 2], [3, 4, 5], [6, 7, 8, 9]):
        c = model.new_cache(1, 16, dtype=torch.float64)
        prefill(model, torch.tensor([p]), c)
        slots.load_row(slots.claim_row(), c, len(p))
        own.append(c)
    assert slots.release_row(0) == 2  # row 2 (4 tokens) now lives in row 0
    assert slots.active == 2 and slots.fill_of(0) == 4 and slots.fill_of(1) == 3
    assert not bool(slots._valid[2].any())
    out = decode_step(model, torch.tensor([1, 1]), slots, position_ids=slots.positions())
    torch.testing.assert_close(out[0:1], decode_step(model, torch.tensor([1]), own[2]), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[1:2], decode_step(model, torch.tensor([1]), own[1]), rtol=1e-10, atol=1e-10)
    assert slots.release_row(1) is None and slots.active == 1


def test_slot_limits_are_errors():
    slots = SlotKVCache(1, 1, 1, 2, 4)
    slots.claim_row()
    with pytest.raises(RuntimeError, match="all 1 KV slots"):
        slots.claim_row()
    with pytest.raises(ValueError, match="not live"):
        slots.release_row(3)
    with pytest.raises(ValueError, match="one real token"):
        slots.reserve(2)
    source = KVCache(1, 1, 1, 2, 4)
    source.pos = 2  # two positions written
    with pytest.raises(ValueError, match="3 positions asked of a cache that holds 2"):
        slots.load_row(0, source, 3)

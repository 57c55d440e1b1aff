"""A KV cache is allocated unfilled: no generation path may read a slot it has not written.

Every cache built here starts as NaN instead of whatever memory held (often zeros, which would hide a stray read):
greedy, a left-padded batch, beam search (reorders rows), speculative decoding (rolls rows back per row) and the
serving slots (whose decode steps do read unwritten, masked slots, so that cache's storage is zeros) must give
exactly what they give on zero-filled caches.
"""
from __future__ import annotations

import pytest
import torch
from gen_helpers import tiny_decoder

from seqlab.generate import GenerationConfig, generate_output
from seqlab.generate.engine import decode_step, prefill
from seqlab.model import cache as cache_module
from seqlab.model.slot_cache import SlotKVCache
from seqlab.runtime.memory import zeros_on_demand

PROMPTS = [[5, 9, 13, 2, 7, 31, 4], [11, 3], [40, 41, 42, 1, 17]]


def left_pad(prompts, pad=0):
    T = max(map(len, prompts))
    return (torch.tensor([[pad] * (T - len(p)) + p for p in prompts]),
            torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts]))


def _filled_with(value: float, monkeypatch) -> None:
    """Every cache allocated with the default storage starts as ``value``."""
    monkeypatch.setattr(cache_module, "unfilled", lambda shape, dtype, device: torch.full(shape, value, dtype=dtype,
                                                                                          device=device))


CONFIGS = {
    "greedy": dict(max_new_tokens=12),
    "beam": dict(max_new_tokens=6, num_beams=3),
    "speculative": dict(max_new_tokens=12, num_speculative_tokens=3),
    "sampled": dict(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20, seed=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_path_reads_an_unwritten_slot(name, monkeypatch):
    model = tiny_decoder(seed=41)
    draft = tiny_decoder(seed=42, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1) if name == "speculative" else None
    ids, mask = left_pad(PROMPTS)
    cfg = GenerationConfig(**CONFIGS[name])

    def run():
        return generate_output(model, ids, mask, cfg, draft_model=draft).sequences

    with monkeypatch.context() as m:
        _filled_with(0.0, m)
        zeros = run()
    with monkeypatch.context() as m:
        _filled_with(float("nan"), m)
        nans = run()
    assert torch.equal(nans, zeros)


@torch.no_grad()
@pytest.mark.parametrize("storage", [None, zeros_on_demand], ids=["default", "zeros on demand (the server's)"])
def test_serving_slots_start_zeroed_so_masked_slots_stay_harmless(storage, monkeypatch):
    _filled_with(float("nan"), monkeypatch)
    model = tiny_decoder().double()
    cfg = model.config
    slots = SlotKVCache(cfg.n_layers, 3, cfg.n_kv_heads, cfg.head_dim, 32, dtype=torch.float64, storage=storage)
    alone = []
    for p in ([5, 7, 9], [1, 2, 3, 4, 5, 6, 7, 8]):  # rows at different fills: the short row's tail is masked
        own = model.new_cache(1, 32, dtype=torch.float64)
        prefill(model, torch.tensor([p]), own)
        slots.load_row(slots.claim_row(), own, len(p))
        alone.append(own)
    tokens = torch.tensor([3, 4])
    batched = decode_step(model, tokens, slots, position_ids=slots.positions())
    assert torch.isfinite(batched).all()
    for i, own in enumerate(alone):
        torch.testing.assert_close(batched[i : i + 1], decode_step(model, tokens[i : i + 1], own),
                                   rtol=1e-10, atol=1e-10)

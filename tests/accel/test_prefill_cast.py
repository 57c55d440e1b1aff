"""bf16 prefill of an fp32 model: only where bf16 is native and a timed prefill wins; fp32 decode steps after it."""
import pytest
import torch

from seqlab.accel import accelerate, calibrate, prefill as accel_prefill
from seqlab.accel.prefill import PrefillCast, choose_prefill_cast, prefill_key
from seqlab.config import ModelConfig
from seqlab.generate.engine import decode_step, prefill
from seqlab.model import build_model
from seqlab.runtime.cpu import current_signature, native_bf16

from .helpers import tiny_model

BF16_ATOL = 5e-2  # bf16 products keep 8 significant bits: this tiny model's logits move by up to ~1e-2


def long_context_model():
    """tiny_model's shapes with room for every timed prompt length (the timings themselves are faked)."""
    torch.manual_seed(0)
    return build_model(ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                                   max_seq_len=512)).eval()


def test_short_prompts_stay_fp32_and_long_ones_run_bf16_products():
    cast = PrefillCast(torch.bfloat16, min_tokens=8)
    with cast.context(7):
        assert not torch.is_autocast_enabled("cpu")
    with cast.context(8):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_a_cast_prefill_fills_the_fp32_cache_and_decoding_continues_in_fp32():
    model, plain = tiny_model(), tiny_model()
    model.prefill_cast = PrefillCast(torch.bfloat16, min_tokens=4)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        c1, c2 = model.new_cache(2, 16), plain.new_cache(2, 16)
        got, want = prefill(model, ids, c1), prefill(plain, ids, c2)
        assert got.dtype == torch.float32 and c1.k[0].dtype == torch.float32
        torch.testing.assert_close(got, want, atol=BF16_ATOL, rtol=0)
        assert not torch.equal(c1.k[0], c2.k[0])  # the products really ran in bf16
        tok = want.argmax(-1)
        torch.testing.assert_close(decode_step(model, tok, c1), decode_step(plain, tok, c2), atol=BF16_ATOL, rtol=0)


def test_not_native_or_not_faster_means_no_cast(monkeypatch):
    monkeypatch.setattr(accel_prefill, "native_bf16", lambda: False)
    assert choose_prefill_cast(long_context_model()) == (None, {})
    monkeypatch.setattr(accel_prefill, "native_bf16", lambda: True)
    slow = {"fp32": 1.0, "bf16": 0.9}  # faster, but not by MIN_SPEEDUP: timing noise must not change the numbers
    monkeypatch.setattr(accel_prefill, "time_prefills", lambda model, length: slow)
    cast, timings = choose_prefill_cast(long_context_model())
    assert cast is None and set(timings) == {f"{d}@{n}" for d in ("fp32", "bf16") for n in accel_prefill.LENGTHS}


def test_the_shortest_winning_length_is_the_threshold_and_is_cached(monkeypatch):
    monkeypatch.setattr(accel_prefill, "native_bf16", lambda: True)
    timed = []

    def fake(model, length):
        timed.append(length)
        return {"fp32": 1.0, "bf16": 0.9 if length < 128 else 0.5}

    monkeypatch.setattr(accel_prefill, "time_prefills", fake)
    cast, _ = choose_prefill_cast(long_context_model())
    assert cast == PrefillCast(torch.bfloat16, 128) and timed == [64, 128]  # 256 not timed: 128 already won
    assert prefill_key(long_context_model()) in calibrate.load_cache(current_signature())
    monkeypatch.setattr(accel_prefill, "time_prefills", lambda *a: pytest.fail("timed although cached"))
    assert choose_prefill_cast(long_context_model())[0] == cast


def test_accelerate_casts_only_under_auto(monkeypatch):
    monkeypatch.setattr(accel_prefill, "native_bf16", lambda: True)
    monkeypatch.setattr(accel_prefill, "time_prefills", lambda model, length: {"fp32": 1.0, "bf16": 0.1})
    exact = accelerate(long_context_model(), "decode", rows=1, dtype="fp32", budget_s=0.2)
    assert "prefill_cast" not in exact.__dict__ and not exact.accel_plan.prefill_s
    auto = accelerate(long_context_model(), "decode", rows=1, dtype="auto", budget_s=0.2)
    assert auto.prefill_cast.min_tokens == 64 and auto.accel_plan.prefill_from == 64
    assert "prefill in bf16" in auto.accel_plan.summary()
    assert next(auto.parameters()).dtype == torch.float32  # the weights stay fp32


@pytest.mark.skipif(not native_bf16(), reason="measures real bf16 prefills only where bf16 is native")
def test_real_timings_on_this_machine():
    timings = accel_prefill.time_prefills(tiny_model(), 16)
    assert timings["fp32"] > 0 and timings["bf16"] > 0

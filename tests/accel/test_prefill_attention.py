"""The prefill's causal attention kernel: SDPA's result to fp32 rounding, only for the calls it was built for, and only
where a timing says it is faster."""
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from seqlab.accel import accelerate, calibrate, restore_plain
from seqlab.accel import prefill_attention as pa
from seqlab.config import ModelConfig
from seqlab.generate.engine import prefill
from seqlab.accel.routes import Use
from seqlab.model import build_model
from seqlab.runtime.cpu import current_signature

from .helpers import SleepyPacked, assert_same_prefill_and_next_step

ISAS = pa.available_isas()
needs_kernel = pytest.mark.skipif(not ISAS, reason="no C compiler: the kernel cannot be built here")


def model_layout(batch: int, length: int, heads: int, kv: int, dim: int, seed: int = 0):
    """q as the model passes it (a strided view of the fused projection), k and v as the cache holds them."""
    qkv = torch.randn(batch, length, heads + 2 * kv, dim, generator=torch.Generator().manual_seed(seed))
    q, k, v = (t.transpose(1, 2) for t in qkv.split((heads, kv, kv), dim=2))
    cache = torch.zeros(2, batch, kv, length + 7, dim)  # room for more positions: the cache's strides
    cache[0, :, :, :length], cache[1, :, :, :length] = k, v
    return q, cache[0, :, :, :length], cache[1, :, :, :length]


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads,kv,dim", [(4, 4, 32), (6, 2, 64), (3, 1, 96)])
@pytest.mark.parametrize("length", [1, 5, 47, 48, 49, 100, 530])  # around the 48-query blocks and 512-key blocks
def test_the_kernel_equals_sdpa_causal(isa, heads, kv, dim, length):
    q, k, v = model_layout(2, length, heads, kv, dim, seed=length)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv)
    got = pa.causal_attention(q, k, v, isa=isa)
    assert got is not None and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    # laid out [B, T, H, D]: the reshape after attention is a view
    assert got.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(pa.causal_attention(q, k, v, scale=0.05, isa=isa),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.05,
                                                              enable_gqa=heads != kv), atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("length", [5, 49, 530])
def test_bf16_inputs_are_computed_in_fp32_and_rounded_once(isa, length):
    q, k, v = (t.bfloat16() for t in model_layout(2, length, 6, 2, 64, seed=length))
    got = pa.causal_attention(q, k, v, isa=isa)
    assert got.dtype == torch.bfloat16
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got.float(), exact, atol=4e-3, rtol=4e-3)  # bf16 keeps 8 bits: 2^-8 = 3.9e-3
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                               atol=2e-2, rtol=2e-2)  # SDPA's own bf16 path rounds along the way too


def test_it_takes_only_the_calls_it_was_built_for():
    q, k, v = model_layout(1, 20, 4, 2, 32)
    assert pa.takes(q, k, v, is_causal=True)
    assert not pa.takes(q, k, v, is_causal=False)  # bidirectional (an encoder)
    assert not pa.takes(q, k, v, attn_mask=torch.ones(1, 1, 20, 20, dtype=torch.bool), is_causal=True)  # padding
    assert not pa.takes(q, k, v, dropout_p=0.1, is_causal=True)
    assert not pa.takes(q[:, :, -1:], k, v, is_causal=True)  # one query against a filled cache
    assert pa.takes(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)
    assert not pa.takes(q.bfloat16(), k, v, is_causal=True)  # mixed dtypes (autocast's leftovers)
    assert not pa.takes(q.half(), k.half(), v.half(), is_causal=True)
    assert not pa.takes(q.clone().requires_grad_(), k, v, is_causal=True)  # training needs SDPA's backward
    q16, k16, v16 = model_layout(1, 20, 4, 2, 16)
    assert not pa.takes(q16, k16, v16, is_causal=True)  # a head width the tiles do not divide


@needs_kernel
def test_it_falls_back_to_sdpa_for_everything_else(monkeypatch):
    ran = []
    real = pa.causal_attention
    monkeypatch.setattr(pa, "causal_attention", lambda *a, **k: ran.append(a[0].shape[2]) or real(*a, **k))
    q, k, v = model_layout(1, 70, 4, 2, 32)
    mask = torch.rand(1, 1, 70, 70, generator=torch.Generator().manual_seed(1)) > 0.3
    attend = pa.PrefillAttention(64, ISAS[0])
    causal = attend(q, k, v, is_causal=True, enable_gqa=True)
    masked = attend(q, k, v, attn_mask=mask, enable_gqa=True)
    short = attend(q[:, :, :40], k[:, :, :40], v[:, :, :40], is_causal=True, enable_gqa=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the bf16 route: bf16 queries, the fp32 cache's keys
        under_autocast = attend(q.bfloat16(), k, v, is_causal=True, enable_gqa=True)
    assert ran == [70, 70]  # only the causal calls of at least min_len queries
    assert under_autocast.dtype == torch.float32  # computed in fp32 from the widened queries
    torch.testing.assert_close(under_autocast, F.scaled_dot_product_attention(
        q.bfloat16().float(), k, v, is_causal=True, enable_gqa=True), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(causal, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                               atol=2e-6, rtol=1e-5)
    assert torch.equal(masked, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    assert torch.equal(short, F.scaled_dot_product_attention(q[:, :, :40], k[:, :, :40], v[:, :, :40],
                                                             is_causal=True, enable_gqa=True))


def kernel_model():
    torch.manual_seed(0)  # head_dim 32: a width the kernel takes
    return build_model(ModelConfig(vocab_size=97, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                                   max_seq_len=256)).eval()


@needs_kernel
def test_an_accelerated_prefill_runs_the_kernel_and_keeps_the_plain_logits_and_cache(monkeypatch):
    monkeypatch.setattr(pa, "time_attention", lambda h, g, d, n, isas, clock=None: {"sdpa": 1.0} | {
        i: 0.5 for i in isas})  # faked: this test is about what runs once chosen, not about this CPU
    ran = []
    real = pa.causal_attention
    monkeypatch.setattr(pa, "causal_attention", lambda *a, **k: ran.append(a[0].shape[2]) or real(*a, **k))
    model, plain = accelerate(kernel_model(), "decode", rows=1, dtype="fp32", budget_s=0.2), kernel_model()
    assert model.prefill_attention.min_len == 64 and "64+ tokens on seqlab's kernel" in model.accel_plan.summary()
    assert set(ran) == {64, 256}  # the prefill routes were timed with the kernel in place
    ran.clear()
    ids = torch.randint(0, 97, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        c1, c2 = model.new_cache(1, 90), plain.new_cache(1, 90)
        got, want = prefill(model, ids, c1), prefill(plain, ids, c2)
        assert ran == [80]  # the first layer; the last one attends from the last position only (SDPA)
        assert_same_prefill_and_next_step(model, plain, got, want, c1, c2)
    restore_plain(model)
    assert "prefill_attention" not in model.__dict__
    assert all(m.attend is F.scaled_dot_product_attention for m in model.modules() if hasattr(m, "attend"))


def test_a_kernel_slower_than_sdpa_is_not_chosen_and_the_verdict_is_cached(monkeypatch):
    if not ISAS:
        monkeypatch.setattr(pa, "available_isas", lambda: ["avx2"])
    timed = []
    times = {64: 1.0, 256: 0.95, 1024: 0.8}  # the kernel's time as a fraction of SDPA's: a win from 1024 only

    def fake(h, g, d, n, isas, clock=None):
        timed.append(n)
        return {"sdpa": 1.0} | {i: times[n] for i in isas}

    monkeypatch.setattr(pa, "time_attention", fake)
    choice = pa.choose_attention(4, 2, 32, max_len=4096)
    assert timed == [64, 256, 1024] and choice.min_len == 1024 and choice.isa is not None
    monkeypatch.setattr(pa, "time_attention", lambda *a, **k: pytest.fail("timed although cached"))
    assert pa.choose_attention(4, 2, 32, max_len=4096) == choice
    times.update({1024: 1.5})  # slower everywhere: SDPA stays
    monkeypatch.setattr(pa, "time_attention", fake)
    assert pa.choose_attention(4, 2, 32, max_len=4096, use_cache=False).isa is None
    assert pa.choose_attention(4, 2, 16, max_len=4096, use_cache=False).isa is None  # a width it cannot take



def test_a_build_that_declines_gets_no_timing(monkeypatch):
    """A build that returns None (its scratch could not be allocated) did not compute the attention: however quick
    that was, it must not count as a time, or the calibration would choose a kernel that never runs."""
    calls = Counter()

    def declining(q, k, v, isa="avx2"):
        calls[isa] += 1
        return None

    monkeypatch.setattr(pa, "causal_attention", declining)
    timings = pa.time_attention(4, 2, 32, 16, ["avx2"])
    assert calls["avx2"] == pa.ROUNDS + 1  # the warm-up and every round called it
    assert timings["avx2"] == float("inf") and 0 < timings["sdpa"] < float("inf")

def test_a_shorter_model_calibrated_first_does_not_break_a_longer_one(monkeypatch):
    """The lengths timed depend on the model's longest prompt: they are part of the cached entry's key."""
    if not ISAS:
        monkeypatch.setattr(pa, "available_isas", lambda: ["avx2"])
    monkeypatch.setattr(pa, "time_attention", lambda h, g, d, n, isas, clock=None: {"sdpa": 1.0} | {
        i: 0.5 for i in isas})
    assert pa.choose_attention(4, 2, 32, max_len=128).min_len == 64
    assert pa.choose_attention(4, 2, 32, max_len=4096).min_len == 64
    assert pa.choose_attention(4, 2, 32, max_len=32).isa is None  # too short to time: SDPA


class Trap(SleepyPacked):
    """Fast per shape (the seeded cache says so), 5 ms per product in the whole pass: the routes get dropped."""

    name = "trap"
    sleep_s = 0.005


def accelerate_into_the_trap(model):
    """Accelerate ``model`` for decoding, its per-product routes all Trap's: chosen per shape, dropped whole."""
    use = Use("decode", 1, torch.float32)
    shapes = Counter((m.in_features, m.out_features, m.bias is not None) for m in model.modules()
                     if type(m) is nn.Linear)
    calibrate.store_cache(current_signature(), {calibrate.shape_key(use, *s, extra_routes=["trap"]):
                                                {"dense": 1.0, "trap": 0.1} for s in shapes})
    return accelerate(model, "decode", rows=1, dtype="fp32", routes=[Trap()], fused=False)


@needs_kernel
def test_the_kernel_stays_when_the_product_routes_lose_the_whole_pass(monkeypatch):
    monkeypatch.setattr(pa, "time_attention", lambda h, g, d, n, isas, clock=None: {"sdpa": 1.0} | {
        i: 0.5 for i in isas})
    model = accelerate_into_the_trap(kernel_model())
    assert not model.accel_plan.kept  # the layers went back to plain ...
    assert "prefill_attention" in model.__dict__  # ... the attention, chosen by its own timing, stayed
    assert "64+ tokens on seqlab's kernel" in model.accel_plan.summary()


def test_the_prefill_product_route_survives_the_layer_conversion_and_its_undoing(monkeypatch):
    """The oneDNN switch sits on plain layers: it comes off while the per-product routes are timed and converted
    (a routed layer refers to itself, so a replaced one would outlive its replacement) and goes back on the layers
    that are plain at the end, here all of them, after the whole-pass check dropped the routes."""
    from seqlab.accel import prefill as accel_prefill

    times = {"fp32": 1.0, "onednn": 0.5, "bf16": 0.9}  # oneDNN's fp32 wins the prefill
    monkeypatch.setattr(accel_prefill, "time_prefills", lambda model, length, casts: {k: times[k] for k in casts})
    model = accelerate_into_the_trap(kernel_model())
    assert not model.accel_plan.kept and model.prefill_cast.dtype == torch.float32
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m.__dict__.get("forward"), accel_prefill.RoutedForward) for m in linears)
    restore_plain(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


@needs_kernel
def test_it_takes_sdpa_keywords_and_leaves_what_it_cannot_take_to_sdpa():
    q, k, v = model_layout(1, 70, 4, 4, 32)
    attend = pa.PrefillAttention(64, ISAS[0])
    by_name = attend(query=q, key=k, value=v, is_causal=True)
    flat = attend(q, k[0], v[0], is_causal=True)  # 3-D keys: SDPA broadcasts them
    torch.testing.assert_close(by_name, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=2e-6, rtol=1e-5)
    assert torch.equal(flat, F.scaled_dot_product_attention(q, k[0], v[0], is_causal=True))


@needs_kernel
def test_the_output_is_on_the_inputs_device_whatever_the_default_device():
    q, k, v = model_layout(1, 20, 4, 2, 32)
    with torch.device("meta"):
        out = pa.causal_attention(q, k, v, isa=ISAS[0])
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                               atol=2e-6, rtol=1e-5)


@needs_kernel
def test_a_bf16_model_gets_the_kernel_chosen_for_bf16(monkeypatch):
    timed = []

    def fake(h, g, d, n, isas, dtype=torch.float32, clock=None):
        timed.append(dtype)
        return {"sdpa": 1.0} | {i: 0.5 for i in isas}

    monkeypatch.setattr(pa, "time_attention", fake)
    model = accelerate(kernel_model().bfloat16(), "decode", rows=1, dtype=None, budget_s=0.2)
    plain = kernel_model().bfloat16()
    assert set(timed) == {torch.bfloat16} and "prefill_attention" in model.__dict__
    ids = torch.randint(0, 97, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got, want = prefill(model, ids, model.new_cache(1, 90)), prefill(plain, ids, plain.new_cache(1, 90))
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=0)  # bf16 rounding, in other places


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_a_nan_key_reaches_every_query_that_sees_it_as_in_sdpa(isa):
    """The kernel's exp clamped a NaN score to -87.3 (max/min return their second operand for a NaN), so a NaN key
    vanished: finite rows and a finite training loss for a run gone to NaN."""
    from seqlab.accel.train_attention import TrainAttention

    q, k, v = model_layout(1, 8, 2, 2, 32)
    k = k.clone()
    k[0, 0, 2, 1] = float("nan")
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True).isnan().any(-1)
    assert want[0, 0].nonzero().flatten().tolist() == [2, 3, 4, 5, 6, 7]
    assert torch.equal(pa.causal_attention(q, k, v, isa=isa).isnan().any(-1), want)
    out = TrainAttention({torch.float32: isa})(q.clone().requires_grad_(), k, v, is_causal=True)
    assert torch.equal(out.isnan().any(-1), want)

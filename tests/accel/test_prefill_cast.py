"""The prefill route of an fp32 model: bf16 only under "auto", where native and a timed prefill wins; fp32 on oneDNN
wherever it wins; fp32 decode steps after either."""
import copy

import pytest
import torch

from seqlab.accel import accelerate, calibrate, prefill as accel_prefill, train_linear
from seqlab.accel.prefill import PrefillCast, candidate_casts, choose_prefill_cast, prefill_key
from seqlab.config import ModelConfig
from seqlab.generate.engine import decode_step, prefill
from seqlab.model import build_model
from seqlab.quant import quantize
from seqlab.runtime.cpu import current_signature, native_bf16

from .helpers import tiny_model

REAL_TIME_HEAD = accel_prefill.time_head  # before the autouse fixture below replaces it
BF16_ATOL = 5e-2  # bf16 products keep 8 significant bits: this tiny model's logits move by up to ~1e-2


def long_context_model():
    """tiny_model's shapes with room for every timed prompt length (the timings themselves are faked)."""
    torch.manual_seed(0)
    return build_model(ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                                   max_seq_len=512)).eval()


@pytest.fixture(autouse=True)
def _head_routes_tie(monkeypatch):
    """The head's own timing (real elsewhere) ties here, so the chains under test keep the head plain."""
    monkeypatch.setattr(accel_prefill, "time_head", lambda model: {"fp32": 1.0, "onednn": 1.0})


def test_the_heads_product_takes_onednn_where_its_own_timing_says_so(monkeypatch):
    """A Zen 3's 6-layer case: the body plain from 256 tokens, the head (one row against the whole head weight)
    3.3 ms on oneDNN against 5.7 on MKL -> the head on oneDNN for every prompt the chain covers."""
    times = {64: {"fp32": 0.0363, "onednn": 0.0321}, 256: {"fp32": 0.0823, "onednn": 0.0851},
             512: {"fp32": 0.170, "onednn": 0.176}}
    monkeypatch.setattr(accel_prefill, "time_prefills",
                        lambda model, length, casts: {k: times[length][k] for k in casts})
    monkeypatch.setattr(accel_prefill, "time_head", lambda model: {"fp32": 0.0057, "onednn": 0.0033})
    model = long_context_model()
    cast, timings = choose_prefill_cast(model, allow_bf16=False)
    assert cast == PrefillCast(torch.float32, 64, PrefillCast(None, 256), head_onednn=True)
    assert cast.label == "64+ tokens in fp32 on oneDNN, 256+ in plain fp32; the head on oneDNN"
    assert timings["head onednn"] == 0.0033
    for n, body in ((100, True), (1000, False)):
        with cast.context(n):
            assert accel_prefill._ONEDNN.get() is body
        with cast.head_context(n):
            assert accel_prefill._ONEDNN.get()
    with cast.head_context(63):
        assert not accel_prefill._ONEDNN.get()
    times[64]["onednn"] = 0.0359  # oneDNN wins no length of the body: no chain, no head route either
    assert choose_prefill_cast(model, use_cache=False, allow_bf16=False)[0] is None
    assert not any("forward" in m.__dict__ for m in model.modules())  # and no switch left on the layers


def test_the_heads_timing_on_this_machine():
    model = tiny_model()
    accel_prefill.install(model)
    timings = REAL_TIME_HEAD(model)
    assert set(timings) == {"fp32", "onednn"} and all(t > 0 for t in timings.values())


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
        assert not torch.equal(c1.k[0][:, :, :9], c2.k[0][:, :, :9])  # the products really ran in bf16
        tok = want.argmax(-1)
        torch.testing.assert_close(decode_step(model, tok, c1), decode_step(plain, tok, c2), atol=BF16_ATOL, rtol=0)


def test_an_onednn_prefill_is_fp32_and_runs_its_products_on_onednn(monkeypatch):
    model, plain = tiny_model(), tiny_model()
    model.prefill_cast = PrefillCast(torch.float32, min_tokens=4, head_onednn=True)
    accel_prefill.install(model)  # the layers' switch (choose_prefill_cast installs it)
    calls = []

    def counting(x, weight, bias=None):
        calls.append(tuple(x.shape))
        return train_linear.onednn_linear(x, weight, bias)

    monkeypatch.setattr(accel_prefill, "onednn_linear", counting)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        c1, c2 = model.new_cache(2, 16), plain.new_cache(2, 16)
        got, want = prefill(model, ids, c1), prefill(plain, ids, c2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # fp32: only the summation order differs
        torch.testing.assert_close(c1.k[0][:, :, :9], c2.k[0][:, :, :9], atol=1e-5, rtol=1e-5)  # slots written
        # every layer's products: the last layer's after its K/V on each row's last position only; then the head
        body, head = calls[:-1], calls[-1]
        assert len(body) >= 2 * 4 and all(shape[:2] in ((2, 9), (2, 1)) for shape in body)
        assert sum(shape[:2] == (2, 9) for shape in body) > len(body) // 2
        assert head == (2, model.config.d_model)  # the head's product of the last positions, on oneDNN too
        calls.clear()
        model.prefill_cast = PrefillCast(torch.float32, min_tokens=4)  # the head's own timing chose MKL
        prefill(model, ids, model.new_cache(2, 16))
        assert calls and all(shape != (2, model.config.d_model) for shape in calls)
        model.prefill_cast = PrefillCast(torch.float32, min_tokens=4, head_onednn=True)
        calls.clear()
        tok = want.argmax(-1)
        torch.testing.assert_close(decode_step(model, tok, c1), decode_step(plain, tok, c2), atol=1e-5, rtol=1e-5)
        assert calls == []  # decode steps keep their own route
        prefill(model, ids[:, :1], model.new_cache(2, 16))
        assert calls == []  # 2 tokens: below min_tokens, plain products


def test_not_native_or_not_faster_means_no_cast(monkeypatch):
    monkeypatch.setattr(accel_prefill, "native_bf16", lambda: False)
    assert set(candidate_casts(allow_bf16=True)) == {"fp32", "onednn"}
    slow = {"fp32": 1.0, "onednn": 0.97, "bf16": 0.9}  # faster, but not by the margins: noise must not choose
    monkeypatch.setattr(accel_prefill, "time_prefills", lambda model, length, casts: {k: slow[k] for k in casts})
    cast, timings = choose_prefill_cast(long_context_model())
    assert cast is None and set(timings) == {f"{d}@{n}" for d in ("fp32", "onednn") for n in accel_prefill.LENGTHS}
    monkeypatch.setattr(accel_prefill, "native_bf16", lambda: True)  # (another CPU: not this one's cache)
    cast, timings = choose_prefill_cast(long_context_model(), use_cache=False)
    assert cast is None and {k.split("@")[0] for k in timings} == {"fp32", "onednn", "bf16"}


def test_each_length_takes_its_winner_and_the_timings_are_cached(monkeypatch):
    """An AMD EPYC's SmolLM2 case: oneDNN's fp32 wins at 64 tokens (bf16 only 1.2x ahead), bf16 from 256 (and still
    ahead of the exact routes at 512, where the route that runs every longer prompt is checked)."""
    monkeypatch.setattr(accel_prefill, "native_bf16", lambda: True)
    timed = []
    times = {64: {"fp32": 1.0, "onednn": 0.6, "bf16": 0.5}, 256: {"fp32": 4.0, "onednn": 2.4, "bf16": 1.5},
             512: {"fp32": 8.0, "onednn": 5.0, "bf16": 3.0}}

    def fake(model, length, casts):
        timed.append(length)
        return {k: times[length][k] for k in casts}

    monkeypatch.setattr(accel_prefill, "time_prefills", fake)
    cast, _ = choose_prefill_cast(long_context_model())
    assert cast == PrefillCast(torch.float32, 64, PrefillCast(torch.bfloat16, 256)) and timed == [64, 256, 512]
    assert cast.label == "64+ tokens in fp32 on oneDNN, 256+ in bf16"
    with cast.context(63):
        assert not torch.is_autocast_enabled("cpu") and not accel_prefill._ONEDNN.get()
    with cast.context(255):
        assert not torch.is_autocast_enabled("cpu") and accel_prefill._ONEDNN.get()
    with cast.context(256):
        assert torch.is_autocast_enabled("cpu") and not accel_prefill._ONEDNN.get()
    assert not accel_prefill._ONEDNN.get()
    assert prefill_key(long_context_model()) in calibrate.load_cache(current_signature())
    monkeypatch.setattr(accel_prefill, "time_prefills", lambda *a: pytest.fail("timed although cached"))
    assert choose_prefill_cast(long_context_model())[0] == cast


def test_a_route_that_stops_winning_gives_way_to_plain_products(monkeypatch):
    """A Zen 3 EPYC's 6-layer case: oneDNN's fp32 13 % ahead at 64 tokens, 3 % behind MKL at 256 -> plain from 256.
    A lead under the 1.05x margin at a longer length keeps the route (the margin is for taking one, not keeping it)."""
    times = {64: {"fp32": 0.0363, "onednn": 0.0321}, 256: {"fp32": 0.0823, "onednn": 0.0851},
             512: {"fp32": 0.170, "onednn": 0.165}}
    monkeypatch.setattr(accel_prefill, "time_prefills",
                        lambda model, length, casts: {k: times[length][k] for k in casts})
    cast, _ = choose_prefill_cast(long_context_model(), allow_bf16=False)
    assert cast == PrefillCast(torch.float32, 64, PrefillCast(None, 256))
    assert cast.label == "64+ tokens in fp32 on oneDNN, 256+ in plain fp32"
    with cast.context(255):
        assert accel_prefill._ONEDNN.get()
    for n in (256, 4096):
        with cast.context(n), cast.head_context(n):
            assert not accel_prefill._ONEDNN.get() and not torch.is_autocast_enabled("cpu")
    times[256]["onednn"] = 0.081  # ahead, though by less than the margin
    assert choose_prefill_cast(long_context_model(), use_cache=False, allow_bf16=False)[0] == PrefillCast(
        torch.float32, 64)
    times[256]["onednn"] = 0.0823  # a tie with MKL: kept
    assert choose_prefill_cast(long_context_model(), use_cache=False, allow_bf16=False)[0] == PrefillCast(
        torch.float32, 64)
    times[64]["onednn"] = 0.035  # no winner at 64 either: plain throughout
    assert choose_prefill_cast(long_context_model(), use_cache=False, allow_bf16=False)[0] is None


def test_the_route_left_for_every_longer_prompt_must_not_lose_to_plain_at_512_tokens(monkeypatch):
    """A Zen 3's SmolLM2 case: oneDNN 1.1x ahead of MKL at 64 tokens, still ahead at 256, 7 % behind at 512 (837
    against 779 ms) -> plain from 512. A tie at 512 keeps the route; where plain runs from 256, 512 is timed all the
    same, and only a context shorter than 512 tokens leaves it out."""
    timed = []
    times = {64: {"fp32": 0.166, "onednn": 0.150}, 256: {"fp32": 0.437, "onednn": 0.424},
             512: {"fp32": 0.779, "onednn": 0.837}}

    def fake(model, length, casts):
        timed.append(length)
        return {k: times[length][k] for k in casts}

    monkeypatch.setattr(accel_prefill, "time_prefills", fake)
    cast, timings = choose_prefill_cast(long_context_model(), allow_bf16=False)
    assert cast == PrefillCast(torch.float32, 64, PrefillCast(None, 512))
    assert cast.label == "64+ tokens in fp32 on oneDNN, 512+ in plain fp32"
    assert timed == [64, 256, 512] and timings["onednn@512"] == 0.837
    with cast.context(511):
        assert accel_prefill._ONEDNN.get()
    with cast.context(512):
        assert not accel_prefill._ONEDNN.get()
    monkeypatch.setattr(accel_prefill, "time_prefills", lambda *a: pytest.fail("timed although cached"))
    assert choose_prefill_cast(long_context_model(), allow_bf16=False)[0] == cast  # 512 is cached too
    monkeypatch.setattr(accel_prefill, "time_prefills", fake)
    times[512]["onednn"] = 0.779  # a tie: the route goes on
    assert choose_prefill_cast(long_context_model(), use_cache=False, allow_bf16=False)[0] == PrefillCast(
        torch.float32, 64)
    times[256]["onednn"] = 0.45  # plain from 256, and (a tie) at 512 too
    timed.clear()
    assert choose_prefill_cast(long_context_model(), use_cache=False, allow_bf16=False)[0] == PrefillCast(
        torch.float32, 64, PrefillCast(None, 256))
    assert timed == [64, 256, 512]
    times[256]["onednn"] = 0.424  # a context shorter than 512 tokens: 512 is not timed
    timed.clear()
    short = build_model(ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                                    max_seq_len=511)).eval()
    assert choose_prefill_cast(short, use_cache=False, allow_bf16=False)[0] == PrefillCast(torch.float32, 64)
    assert timed == [64, 256]


def test_timings_without_512_tokens_do_not_stand_in_for_a_model_with_room_for_them(monkeypatch):
    """A shorter context's entry (64 and 256 tokens timed), like a cache written before 512 was a timed length, is
    not the entry of a model of the same shapes with room for 512 tokens: that one times all three lengths (it took
    the shorter entry and never timed 512)."""
    timed = []
    monkeypatch.setattr(accel_prefill, "time_prefills",
                        lambda model, length, casts: timed.append(length) or {k: 1.0 for k in casts})
    short = build_model(ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                                    max_seq_len=511)).eval()
    choose_prefill_cast(short, allow_bf16=False)
    choose_prefill_cast(long_context_model(), allow_bf16=False)
    assert timed == [64, 256, 64, 256, 512]


def test_a_route_that_leads_only_at_512_tokens_takes_the_longest_prompts(monkeypatch):
    """A Zen 4 under the AVX2 caps, SmolLM2: oneDNN's prefill within its margin of MKL's at 64 and 256 tokens, 8 %
    ahead at 512 -> plain up to 511 tokens, oneDNN from 512 (512 is timed whatever the shorter lengths chose)."""
    times = {64: {"fp32": 0.130, "onednn": 0.127}, 256: {"fp32": 0.367, "onednn": 0.357},
             512: {"fp32": 0.753, "onednn": 0.697}}
    monkeypatch.setattr(accel_prefill, "time_prefills",
                        lambda model, length, casts: {k: times[length][k] for k in casts})
    cast, _ = choose_prefill_cast(long_context_model(), allow_bf16=False)
    assert cast == PrefillCast(torch.float32, 512) and cast.label == "512+ tokens in fp32 on oneDNN"
    with cast.context(511):
        assert not accel_prefill._ONEDNN.get()
    with cast.context(4096):
        assert accel_prefill._ONEDNN.get()
    times[512]["onednn"] = 0.730  # 3 % ahead: within the margin, plain throughout
    assert choose_prefill_cast(long_context_model(), use_cache=False, allow_bf16=False)[0] is None


def test_a_bf16_route_at_512_tokens_gives_way_to_a_faster_exact_one(monkeypatch):
    """bf16 wins from 64 tokens; at 512 oneDNN's fp32 measures faster: oneDNN from 512 (exact, and faster)."""
    monkeypatch.setattr(accel_prefill, "native_bf16", lambda: True)
    times = {64: {"fp32": 1.0, "onednn": 0.9, "bf16": 0.5}, 256: {"fp32": 4.0, "onednn": 3.5, "bf16": 2.0},
             512: {"fp32": 8.0, "onednn": 4.0, "bf16": 4.4}}
    monkeypatch.setattr(accel_prefill, "time_prefills",
                        lambda model, length, casts: {k: times[length][k] for k in casts})
    cast, _ = choose_prefill_cast(long_context_model())
    assert cast == PrefillCast(torch.bfloat16, 64, PrefillCast(torch.float32, 512))
    assert cast.label == "64+ tokens in bf16, 512+ in fp32 on oneDNN"
    times[512]["onednn"] = 7.8  # oneDNN no faster than plain by its margin, bf16 slower than plain: plain from 512
    times[512]["bf16"] = 8.5
    assert choose_prefill_cast(long_context_model(), use_cache=False)[0] == PrefillCast(
        torch.bfloat16, 64, PrefillCast(None, 512))


def test_a_kept_bf16_step_gives_way_where_an_exact_route_is_faster(monkeypatch):
    """bf16 taken at 64 tokens; at 256 oneDNN's fp32 is faster than bf16 but not by its 1.05x margin over MKL: the
    bf16 step ends (it changes the numbers and is not the fastest), and MKL, the winner there, takes over."""
    monkeypatch.setattr(accel_prefill, "native_bf16", lambda: True)
    times = {64: {"fp32": 1.0, "onednn": 0.9, "bf16": 0.5}, 256: {"fp32": 1.0, "onednn": 0.97, "bf16": 0.98},
             512: {"fp32": 2.0, "onednn": 1.95, "bf16": 1.99}}
    monkeypatch.setattr(accel_prefill, "time_prefills",
                        lambda model, length, casts: {k: times[length][k] for k in casts})
    cast, _ = choose_prefill_cast(long_context_model())
    assert cast == PrefillCast(torch.bfloat16, 64, PrefillCast(None, 256))
    assert cast.label == "64+ tokens in bf16, 256+ in plain fp32"


def test_bf16_must_beat_the_best_fp32_route_not_just_mkl(monkeypatch):
    """An AMD EPYC's case: oneDNN's fp32 is 2x MKL's; bf16 is 2.2x MKL's but only 1.1x oneDNN's -> fp32 on oneDNN."""
    monkeypatch.setattr(accel_prefill, "native_bf16", lambda: True)
    times = {"fp32": 1.0, "onednn": 0.5, "bf16": 0.45}
    monkeypatch.setattr(accel_prefill, "time_prefills", lambda model, length, casts: {k: times[k] for k in casts})
    assert choose_prefill_cast(long_context_model())[0] == PrefillCast(torch.float32, 64)
    times["bf16"] = 0.3  # now clearly faster than the best fp32 route
    assert choose_prefill_cast(long_context_model(), use_cache=False)[0] == PrefillCast(torch.bfloat16, 64)


def test_accelerate_casts_to_bf16_only_under_auto(monkeypatch):
    monkeypatch.setattr(accel_prefill, "native_bf16", lambda: True)
    times = {"fp32": 1.0, "onednn": 1.0, "bf16": 0.1}
    monkeypatch.setattr(accel_prefill, "time_prefills", lambda model, length, casts: {k: times[k] for k in casts})
    exact = accelerate(long_context_model(), "decode", rows=1, dtype="fp32", budget_s=0.2)
    assert "prefill_cast" not in exact.__dict__ and set(exact.accel_plan.prefill_s) == {
        f"{d}@{n}" for d in ("fp32", "onednn") for n in accel_prefill.LENGTHS}
    auto = accelerate(long_context_model(), "decode", rows=1, dtype="auto", budget_s=0.2)
    assert auto.prefill_cast.min_tokens == 64 and auto.accel_plan.prefill_from == 64
    assert "prompts of 64+ tokens in bf16" in auto.accel_plan.summary()
    assert next(auto.parameters()).dtype == torch.float32  # the weights stay fp32
    times["onednn"] = 0.5  # oneDNN's fp32 wins: taken under --dtype fp32 too
    exact = accelerate(long_context_model(), "decode", rows=1, dtype="fp32", budget_s=0.2, use_cache=False)
    assert exact.prefill_cast == PrefillCast(torch.float32, 64)
    assert "prompts of 64+ tokens in fp32 on oneDNN" in exact.accel_plan.summary()


def test_real_timings_on_this_machine():
    timings = accel_prefill.time_prefills(tiny_model(), 16, candidate_casts(allow_bf16=True))
    assert {"fp32", "onednn"} <= set(timings) and all(t > 0 for t in timings.values())


def test_the_onednn_switch_lives_on_the_layers_and_goes_with_restore_plain(monkeypatch):
    """The fp32 route switches each plain ``nn.Linear``'s forward, not a mode around the pass: the layers stay
    ``nn.Linear`` with their Parameters and state dict; a bf16-only chain and restore_plain leave them plain."""
    import copy

    from torch import nn

    from seqlab.accel import restore_plain

    times = {"fp32": 1.0, "onednn": 0.5}
    monkeypatch.setattr(accel_prefill, "time_prefills", lambda model, length, casts: {k: times[k] for k in casts})
    model = long_context_model()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    cast, _ = choose_prefill_cast(model, allow_bf16=False)
    assert cast == PrefillCast(torch.float32, 64)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is nn.Linear for m in linears)
    assert all(isinstance(m.__dict__.get("forward"), accel_prefill.RoutedForward) for m in linears)
    assert model.state_dict().keys() == weights.keys()
    twin = copy.deepcopy(model)  # each copy's layers route their own weights
    assert all(m.forward.linear is m for m in twin.modules() if isinstance(m, nn.Linear))
    restore_plain(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    monkeypatch.setattr(accel_prefill, "native_bf16", lambda: True)
    times["bf16"] = 0.1  # bf16 everywhere: no fp32 step on oneDNN, so no switch either
    cast, _ = choose_prefill_cast(model, use_cache=False)
    assert cast.dtype == torch.bfloat16 and cast.longer is None
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_quantised_model_times_its_own_prefill(monkeypatch):
    """The timings are keyed by the weights' formats too: a quantised model's products run seqlab.quant's routes, so
    a dense model of the same shapes, timed first and cached, says nothing about them (it did: the dense model's
    "bf16 from 64 tokens" was applied to a quantised SmolLM2 untimed)."""
    dense = long_context_model()
    quantised = quantize(copy.deepcopy(dense), bits=8)
    assert prefill_key(quantised) != prefill_key(dense)
    assert prefill_key(quantised) != prefill_key(quantize(copy.deepcopy(dense), bits=4, group_size=32))
    timed = []

    def fake(model, length, casts):
        timed.append((model, casts))
        return {k: 1.0 for k in casts}

    monkeypatch.setattr(accel_prefill, "native_bf16", lambda: True)
    monkeypatch.setattr(accel_prefill, "time_prefills", fake)
    choose_prefill_cast(dense)
    choose_prefill_cast(quantised)
    assert [m for m, _ in timed] == [dense] * 3 + [quantised] * 3
    # and no oneDNN route where no plain nn.Linear is left for it to route (it would time plain products twice)
    assert [set(t) for m, t in timed] == [{"fp32", "onednn", "bf16"}] * 3 + [{"fp32", "bf16"}] * 3
    assert choose_prefill_cast(quantised, use_cache=False, allow_bf16=False) == (None, {})  # nothing to time


def test_route_for_follows_the_chain_by_prompt_length():
    """What a prompt of n tokens runs (the bench labels its TTFT rows with it): below the first step plain, then
    each step's route from its length on."""
    cast = PrefillCast(torch.float32, 64, PrefillCast(torch.bfloat16, 256, PrefillCast(None, 1024)))
    assert [cast.route_for(n) for n in (16, 64, 255, 256, 512, 1024, 4096)] == [
        "plain fp32", "fp32 on oneDNN", "fp32 on oneDNN", "bf16", "bf16", "plain fp32", "plain fp32"]

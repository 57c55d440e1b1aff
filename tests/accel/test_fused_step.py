"""The fused decode step: the plain model's logits and cache, for every weight format, cache kind and build."""
import copy
import time

import pytest
import torch

from seqlab.accel import accelerate, restore_plain
from seqlab.accel import fused_step, step_check
from seqlab.accel.fused_step import FusedDecodeStep
from seqlab.config import ModelConfig
from seqlab.generate import generate
from seqlab.generate.engine import decode_step, prefill
from seqlab.model import build_model
from seqlab.model.slot_cache import SlotKVCache
from seqlab.quant import quantize

ISAS = fused_step.available_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="no C compiler / AVX2 here: the fused step cannot be built")
# fp32: the same products in another summation order (and expf vs torch's exp): logits (|x| ~ 1) agree to ~1e-6
FP32_ATOL = 2e-5
# bf16 weights: the plain model rounds every op's output to bf16, the fused step keeps fp32 activations
BF16_ATOL = 5e-2

CONFIGS = {
    "llama-gqa-tied": dict(n_heads=4, n_kv_heads=2),
    "qwen2-bias-untied": dict(n_heads=8, n_kv_heads=4, qkv_bias=True, tie_embeddings=False),
    "qwen3-qknorm": dict(n_heads=4, n_kv_heads=1, qk_norm=True, attn_head_dim=32),
    "all-biases": dict(n_heads=4, n_kv_heads=4, bias=True, lm_head_bias=True, tie_embeddings=False),
}


def _model(name: str, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=211, d_model=128, n_layers=2, d_ff=192, max_seq_len=64, **CONFIGS[name])
    return build_model(cfg).eval().to(dtype)


def _ids(rows: int, length: int, seed: int = 1):
    return torch.randint(0, 211, (rows, length), generator=torch.Generator().manual_seed(seed))


def _compare_steps(model, isa: str, rows: int = 3, steps: int = 4, atol: float = FP32_ATOL, mask=None,
                   nan_filled: bool = False):
    """Decode ``steps`` tokens twice from the same prefill, plain and fused, comparing logits and every K/V.
    ``nan_filled``: both caches start as NaN (a cache starts unfilled: no step may read a slot not yet written)."""
    ids = _ids(rows, 7)
    fused = FusedDecodeStep(model, isa)
    with torch.inference_mode():
        plain_cache, fused_cache = model.new_cache(rows, 32), model.new_cache(rows, 32)
        for t in (*plain_cache.k, *plain_cache.v, *fused_cache.k, *fused_cache.v) if nan_filled else ():
            t.fill_(float("nan"))
        tok = prefill(model, ids, plain_cache, mask).argmax(-1)
        prefill(model, ids, fused_cache, mask)
        for _ in range(steps):
            want = decode_step(model, tok, plain_cache)
            got = fused(tok, fused_cache)
            torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
            tok = want.argmax(-1)
        assert fused_cache.pos == plain_cache.pos
        for a, b in zip(fused_cache.k + fused_cache.v, plain_cache.k + plain_cache.v):  # the slots written so far
            torch.testing.assert_close(a[:, :, :plain_cache.pos].float(), b[:, :, :plain_cache.pos].float(),
                                       atol=atol, rtol=0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", CONFIGS)
def test_fp32_fused_step_equals_the_plain_step(name, isa):
    _compare_steps(_model(name), isa)


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_weights_and_cache(isa):
    _compare_steps(_model("qwen3-qknorm", torch.bfloat16), isa, atol=BF16_ATOL)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits,group", [(8, 32), (8, 0), (4, 32), (4, 64)])
def test_quantised_weights_read_in_place(bits, group, isa):
    """int4 / int8 layers: the same products as the quantised layers' own kernels (to fp32 rounding)."""
    model = quantize(_model("llama-gqa-tied"), bits=bits, group_size=group)
    _compare_steps(model, isa)


@pytest.mark.parametrize("isa", ISAS)
def test_left_padded_rows_mask_their_holes(isa):
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :3] = 0
    mask[2, :1] = 0
    _compare_steps(_model("llama-gqa-tied"), isa, mask=mask)
    _compare_steps(_model("llama-gqa-tied"), isa, mask=mask, nan_filled=True)


@pytest.mark.parametrize("isa", ISAS)
def test_slot_cache_rows_at_different_fills(isa):
    """The server's cache: each row writes at its own fill level; the rest of the rows' slots are holes."""
    model = _model("qwen2-bias-untied")
    cfg = model.config
    fused = FusedDecodeStep(model, isa)
    caches = [SlotKVCache(cfg.n_layers, 4, cfg.n_kv_heads, cfg.head_dim, 32) for _ in range(2)]
    with torch.inference_mode():
        for n, prompt in enumerate(([5, 7, 9], [1, 2, 3, 4, 5, 6, 7, 8], [11])):
            own = model.new_cache(1, 32)
            prefill(model, torch.tensor([prompt]), own)
            for slots in caches:
                slots.load_row(slots.claim_row(), own, len(prompt))
        tokens = torch.tensor([3, 4, 5])
        for _ in range(3):
            want = decode_step(model, tokens, caches[0], position_ids=caches[0].positions())
            got = fused(tokens, caches[1], caches[1].positions())
            torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)
            tokens = want.argmax(-1)
    assert [caches[1].fill_of(i) for i in range(3)] == [6, 11, 4]


def test_generate_with_the_installed_step_gives_the_plain_tokens():
    plain, model = _model("llama-gqa-tied"), _model("llama-gqa-tied")
    model.fused_decode = FusedDecodeStep(model, ISAS[-1])
    ids = _ids(2, 5)
    want = generate(plain, ids, max_new_tokens=12)
    got = generate(model, ids, max_new_tokens=12)
    assert torch.equal(got, want)


def test_it_steps_aside_where_it_does_not_apply():
    model = _model("llama-gqa-tied")
    fused = FusedDecodeStep(model, ISAS[0])
    cache = model.new_cache(2, 16)
    tok = torch.tensor([1, 2])
    with torch.no_grad():
        prefill(model, _ids(2, 3), cache)
        assert fused(tok, model.new_cache(2, 16, dtype=torch.float64)) is None  # a cache dtype it does not read
        assert fused(torch.tensor([1]), cache) is None  # rows that do not match the cache
        other = build_model(ModelConfig(vocab_size=211, d_model=128, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=64))
        assert fused(tok, other.new_cache(2, 16)) is None  # another model's cache layout: never read blindly
    assert fused(tok, cache) is None  # gradients wanted: only autograd's path can give them
    model.train()
    with torch.no_grad():
        assert fused(tok, cache) is None  # training mode (dropout)
    with torch.no_grad(), pytest.raises(IndexError, match="rotary table"):
        model.eval()
        fused(tok, cache, position_ids=torch.tensor([[3], [10_000]]))


def test_replaced_weights_are_followed_and_copies_do_not_share_it():
    model = _model("llama-gqa-tied")
    model.fused_decode = FusedDecodeStep(model, ISAS[0])
    twin = copy.deepcopy(model)
    assert twin.fused_decode is None  # a copy must never call into the original's tensors
    model.to(torch.bfloat16)  # every tensor replaced: the step rebuilds its tables from the model
    ref = copy.deepcopy(model)
    ids = _ids(1, 6)
    with torch.inference_mode():
        a, b = model.new_cache(1, 16), ref.new_cache(1, 16)
        tok = prefill(model, ids, a).argmax(-1)
        prefill(ref, ids, b)
        got = decode_step(model, tok, a)
        torch.testing.assert_close(got.float(), decode_step(ref, tok, b).float(), atol=BF16_ATOL, rtol=0)
    assert model.fused_decode._desc.layers[0].qkv.kind == 1  # now reading bf16 weights


def test_unsupported_models_say_why_and_stay_plain():
    gpt2 = build_model(ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, norm="layernorm", mlp="gelu",
                                   pos="learned")).eval()
    assert "norm" in fused_step.unsupported(gpt2)
    with pytest.raises(ValueError, match="fused decode step"):
        FusedDecodeStep(gpt2)
    accelerate(gpt2, "decode", rows=1, dtype="fp32", budget_s=0.2)
    assert getattr(gpt2, "fused_decode", None) is None and not gpt2.accel_plan.step_s
    bert = build_model(ModelConfig(arch="encoder", vocab_size=50, d_model=32, n_layers=1, n_heads=2))
    assert "decoder" in fused_step.unsupported(bert)


def test_accelerate_installs_it_only_where_it_wins(monkeypatch):
    model = _model("llama-gqa-tied")
    accelerate(model, "decode", rows=1, dtype="fp32", budget_s=0.2)
    plan = model.accel_plan
    assert set(plan.step_s) == {"plain", *ISAS}
    if plan.fused:  # it won here: installed, the layers left plain, the summary says so
        assert model.fused_decode.isa == plan.fused and "runs every decode step" in plan.summary()
        assert all(type(m).__name__ != "PackedLinear" for m in model.modules())
    restore_plain(model)
    assert "fused_decode" not in model.__dict__

    # a fused step made slow on purpose is never chosen, whatever the per-shape routes say
    real_call = FusedDecodeStep.__call__

    def slow(self, *args, **kw):
        time.sleep(0.02)
        return real_call(self, *args, **kw)

    monkeypatch.setattr(FusedDecodeStep, "__call__", slow)
    slow_model = _model("qwen2-bias-untied")  # other shapes: no cached verdict to reuse
    accelerate(slow_model, "decode", rows=2, dtype="fp32", budget_s=0.2)
    assert not slow_model.accel_plan.fused and getattr(slow_model, "fused_decode", None) is None
    assert slow_model.accel_plan.step_s["plain"] < min(slow_model.accel_plan.step_s[i] for i in ISAS)
    # the verdict is cached: the next accelerate of the same shapes does not time again
    monkeypatch.setattr(step_check, "time_steps", lambda *a, **k: pytest.fail("timed although cached"))
    accelerate(_model("qwen2-bias-untied", seed=3), "decode", rows=2, dtype="fp32", budget_s=0.2)

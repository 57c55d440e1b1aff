"""The prefill's one-pass RMSNorm, rotary and SwiGLU: torch's results (rotary bitwise, the other two to fp32
rounding), only for the calls they were built for, and only where a timing says they are faster."""
import pytest
import torch
import torch.nn.functional as F

from seqlab.accel import accelerate, restore_plain
from seqlab.accel import pointwise as pw
from seqlab.config import ModelConfig
from seqlab.generate.engine import prefill
from seqlab.model import build_model
from seqlab.model.layers import apply_rotary, gated_activation, rms_norm

from .helpers import assert_same_prefill_and_next_step

ISAS = pw.available_isas()
needs_kernels = pytest.mark.skipif(not ISAS, reason="no C compiler: the kernels cannot be built here")


def rope(batch: int, length: int, dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(batch, length, 1, dim, generator=torch.Generator().manual_seed(seed)) * 6.0
    return angles.cos(), angles.sin()


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 100), (33, 512), (300, 24)])  # tails past the vector width
def test_rms_norm_equals_the_models(isa, rows, dim):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, dim + 5, generator=g)[..., 3:dim + 3] * 3.0  # rows at a stride wider than the width
    weight = torch.rand(dim, generator=g) + 0.5
    got = pw.Kernels(isa, 1).rms_norm(x, weight, 1e-5)
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, rms_norm(x, weight, 1e-5), atol=1e-6, rtol=2e-6)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads,kv,dim", [(4, 4, 32), (6, 2, 64), (3, 1, 48), (2, 1, 20)])
def test_rotary_is_bitwise_the_models(isa, heads, kv, dim):
    """q and k as the model rotates them: a view of the fused projection's output, v's columns left out."""
    B, T = 2, 37
    qkv = torch.randn(B, T, heads + 2 * kv, dim, generator=torch.Generator().manual_seed(dim))
    qk = qkv[:, :, :heads + kv]
    cos, sin = rope(B, T, dim, seed=heads)
    got = pw.Kernels(isa, 1).rotate(qk, cos, sin)
    assert torch.equal(got, apply_rotary(qk, cos, sin))


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows,d_ff", [(1, 96), (9, 1408), (70, 37)])
def test_swiglu_equals_the_models(isa, rows, d_ff):
    h = torch.randn(3, rows, 2 * d_ff, generator=torch.Generator().manual_seed(d_ff)) * 4.0
    got = pw.Kernels(isa, 1).gate(F.silu, h, d_ff)
    assert got.shape == (3, rows, d_ff)
    torch.testing.assert_close(got, gated_activation(F.silu, h, d_ff), atol=1e-6, rtol=2e-6)


def test_everything_else_goes_to_the_models_functions(monkeypatch):
    """Gradients, bf16, another activation, rows one stride cannot walk, too few rows: torch's functions compute
    them (a library that raises when called proves the kernels are never reached)."""
    class Refuse:
        def __getattr__(self, name):
            pytest.fail(f"the kernel {name} was called")

    monkeypatch.setattr(pw, "library", lambda isa: Refuse())
    k = pw.Kernels("avx2", 16)
    x, w = torch.randn(1, 32, 64), torch.rand(64) + 0.5
    cos, sin = rope(1, 32, 64)
    h = torch.randn(1, 32, 128)
    xg = x.clone().requires_grad_()
    out = k.rms_norm(xg, w, 1e-5)
    out.sum().backward()
    assert xg.grad is not None
    wg = w.clone().requires_grad_()
    k.rms_norm(x, wg, 1e-5).sum().backward()
    assert wg.grad is not None
    assert torch.equal(k.rms_norm(x[:, :8], w, 1e-5), rms_norm(x[:, :8], w, 1e-5))  # below min_rows
    assert k.rms_norm(x.bfloat16(), w.bfloat16(), 1e-5).dtype == torch.bfloat16
    qk = torch.randn(1, 32, 6, 64)
    assert torch.equal(k.rotate(qk[:, :, ::2], cos, sin), apply_rotary(qk[:, :, ::2], cos, sin))  # heads apart
    qk2 = torch.randn(2, 32, 6, 64)  # tables broadcast over the batch: not the model's layout
    assert torch.equal(k.rotate(qk2, cos, sin), apply_rotary(qk2, cos, sin))
    assert torch.equal(k.gate(F.gelu, h, 64), gated_activation(F.gelu, h, 64))
    assert torch.equal(k.gate(F.silu, h.bfloat16(), 64), gated_activation(F.silu, h.bfloat16(), 64))
    hg = h.clone().requires_grad_()
    k.gate(F.silu, hg, 64).sum().backward()
    assert hg.grad is not None
    assert torch.equal(k.gate(F.silu, h[:, :3], 64), gated_activation(F.silu, h[:, :3], 64))  # below min_rows


@needs_kernels
def test_outputs_are_on_the_inputs_device_whatever_the_default_device():
    k = pw.Kernels(ISAS[0], 1)
    x, w, h = torch.randn(1, 8, 64), torch.rand(64) + 0.5, torch.randn(1, 8, 64)
    cos, sin = rope(1, 8, 16)
    qk = torch.randn(1, 8, 4, 16)
    with torch.device("meta"):
        outs = k.rms_norm(x, w, 1e-5), k.rotate(qk, cos, sin), k.gate(F.silu, h, 32)
    assert all(o.device.type == "cpu" for o in outs)
    torch.testing.assert_close(outs[0], rms_norm(x, w, 1e-5), atol=1e-6, rtol=2e-6)
    assert torch.equal(outs[1], apply_rotary(qk, cos, sin))


def test_tensor_subclasses_go_to_the_models_functions(monkeypatch):
    """A subclass (a fake, distributed or wrapped tensor) may not own the memory its data_ptr names."""
    class Marked(torch.Tensor):
        pass

    monkeypatch.setattr(pw, "library", lambda isa: pytest.fail("a kernel was called"))
    k = pw.Kernels("avx2", 1)
    x, w = torch.randn(1, 8, 64).as_subclass(Marked), torch.rand(64) + 0.5
    assert isinstance(k.rms_norm(x, w, 1e-5), Marked)
    k.rms_norm(torch.randn(1, 8, 64), w.as_subclass(Marked), 1e-5)
    k.gate(F.silu, torch.randn(1, 8, 64).as_subclass(Marked), 32)
    cos, sin = rope(1, 8, 16)
    k.rotate(torch.randn(1, 8, 4, 16).as_subclass(Marked), cos, sin)


def tiny_model():
    torch.manual_seed(0)
    return build_model(ModelConfig(vocab_size=97, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                                   max_seq_len=256)).eval()


@needs_kernels
def test_an_accelerated_model_runs_the_kernels_and_keeps_the_plain_logits_and_cache(monkeypatch):
    monkeypatch.setattr(pw, "time_pointwise", lambda *shape_rows_isas, clock=None: {"torch": 1.0} | {
        i: 0.5 for i in shape_rows_isas[-1]})  # faked: this test is about what runs once chosen, not this CPU
    calls = []
    real = pw.library
    monkeypatch.setattr(pw, "library", lambda isa: calls.append(isa) or real(isa))
    model, plain = accelerate(tiny_model(), "decode", rows=1, dtype="fp32", budget_s=0.2), tiny_model()
    assert pw.installed(model) is not None and "on seqlab's kernels" in model.accel_plan.summary()
    calls.clear()
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        c1, c2 = model.new_cache(2, 50), plain.new_cache(2, 50)
        got, want = prefill(model, ids, c1), prefill(plain, ids, c2)
        assert len(calls) >= 2 * 4  # per layer two norms, a rotary and a SwiGLU (the last layer's on one row)
        assert_same_prefill_and_next_step(model, plain, got, want, c1, c2)
    restore_plain(model)
    assert pw.installed(model) is None
    assert all(getattr(m, "rotate", apply_rotary) is apply_rotary for m in model.modules())


def test_kernels_slower_than_torch_are_not_chosen_and_the_verdict_is_cached(monkeypatch):
    if not ISAS:
        monkeypatch.setattr(pw, "available_isas", lambda: ["avx2"])
    timed = []
    times = {1: 1.2, 16: 1.0, 64: 0.8, 256: 0.5}  # the kernels' time as a fraction of torch's: a win from 64 on

    def fake(*shape_rows_isas, clock=None):
        n, isas = shape_rows_isas[-2:]
        timed.append(n)
        return {"torch": 1.0} | {i: times[n] for i in isas}

    monkeypatch.setattr(pw, "time_pointwise", fake)
    kernels, timings = pw.choose_pointwise(tiny_model())
    assert timed == list(pw.ROWS) and kernels is not None and kernels.min_rows == 64
    monkeypatch.setattr(pw, "time_pointwise", lambda *a, **k: pytest.fail("timed although cached"))
    assert pw.choose_pointwise(tiny_model()) == (kernels, timings)
    times.update({256: 1.5})  # slower at the most rows: torch stays
    monkeypatch.setattr(pw, "time_pointwise", fake)
    assert pw.choose_pointwise(tiny_model(), use_cache=False)[0] is None
    model = tiny_model()
    model.config.mlp = "gelu"  # no SwiGLU: nothing to time
    assert pw.choose_pointwise(model, use_cache=False) == (None, {})


@needs_kernels
def test_the_real_timing_runs_every_build():
    timings = pw.time_pointwise(128, 4, 2, 32, 96, 16, ISAS)
    assert set(timings) == {"torch", *ISAS} and all(0 < t < 1 for t in timings.values())

"""The fused tanh GELU: torch's values and gradients, installed for training only where it measures faster."""
import pytest
import torch
import torch.nn.functional as F

from seqlab.accel import accelerate, restore_plain
from seqlab.accel import fused_gelu
from seqlab.accel.fused_gelu import FusedGeluTanh
from seqlab.config import ModelConfig
from seqlab.model import build_model
from seqlab.runtime import native

ISAS = [isa for isa in ("avx2", "avx512") if native.isa_allowed(isa) is None and fused_gelu.library(isa) is not None]
pytestmark = pytest.mark.skipif(not ISAS, reason="no C compiler / AVX2 here")


def _inputs(dtype):
    x = torch.randn(97, 129, generator=torch.Generator().manual_seed(0)) * 4
    x.view(-1)[:6] = torch.tensor([0.0, -30.0, 30.0, 1e-6, -1e-6, -88.0])
    return x.to(dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,atol,gatol", [(torch.float32, 2e-6, 2e-5), (torch.bfloat16, 0.07, 0.07)])
def test_values_and_gradients_are_torchs(isa, dtype, atol, gatol):
    x = _inputs(dtype)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = FusedGeluTanh({dtype: isa})(a), F.gelu(b, approximate="tanh")
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    ya.backward(g)
    yb.backward(g)
    assert ya.dtype == dtype and a.grad.dtype == dtype
    torch.testing.assert_close(ya.float(), yb.float(), atol=atol, rtol=1e-5)
    torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=gatol, rtol=1e-4)


def test_a_second_derivative_is_torchs():
    """With a constant incoming gradient (a .sum()) the kernel's gradient was a constant too: the second
    derivative came out without GELU's own term, silently (-6.76 for -6.60)."""
    x = torch.randn(3, 8, requires_grad=True, generator=torch.Generator().manual_seed(0))
    seconds = []
    for act in (FusedGeluTanh({torch.float32: ISAS[0]}), lambda t: F.gelu(t, approximate="tanh")):
        (gx,) = torch.autograd.grad(act(x).sum() + (x ** 3).sum(), x, create_graph=True)
        seconds.append(torch.autograd.grad(gx.sum(), x)[0])
    torch.testing.assert_close(seconds[0], seconds[1], atol=1e-5, rtol=1e-5)


def test_other_layouts_and_dtypes():
    act = FusedGeluTanh({torch.float32: ISAS[0]})
    x = torch.randn(8, 6)
    torch.testing.assert_close(act(x.t()), F.gelu(x.t(), approximate="tanh"), atol=2e-6, rtol=1e-5)  # strided
    d = x.double()
    assert torch.equal(act(d), F.gelu(d, approximate="tanh"))  # float64: torch's own function


def _gpt2(seed=0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=32,
                                   pos="learned", norm="layernorm", mlp="gelu", activation="gelu_tanh", bias=True))


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    model(ids).float().square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_accelerate_puts_it_in_only_where_it_wins_and_restore_takes_it_out(monkeypatch):
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    plain, model = _gpt2(), _gpt2()
    monkeypatch.setattr(fused_gelu, "time_gelus", lambda rows, width, dtype, c: {**dict.fromkeys(c, 0.5), "torch": 1.0})
    accelerate(model, "train", rows=32, dtype="fp32", budget_s=0.2)
    assert all(isinstance(m.act, FusedGeluTanh) for m in fused_gelu.gelu_mlps(model))
    assert "MLP activation" in model.accel_plan.summary() and "fp32 on seqlab's kernel" in model.accel_plan.act
    want, got = _grads(plain, ids), _grads(model, ids)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4)
    restore_plain(model)
    assert not any(isinstance(m.act, FusedGeluTanh) for m in fused_gelu.gelu_mlps(model))

    slow = _gpt2(1)  # other shapes' verdicts are not shared: a fused GELU that loses stays out
    monkeypatch.setattr(fused_gelu, "time_gelus", lambda rows, width, dtype, c: {**dict.fromkeys(c, 2.0), "torch": 1.0})
    accelerate(slow, "train", rows=64, dtype="fp32", budget_s=0.2)
    assert not any(isinstance(m.act, FusedGeluTanh) for m in fused_gelu.gelu_mlps(slow)) and not slow.accel_plan.act


def test_models_without_the_tanh_gelu_are_left_alone():
    llama = build_model(ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2))
    assert fused_gelu.gelu_mlps(llama) == []
    assert fused_gelu.choose_gelu(llama, 64, (torch.float32,)) == (None, {})


def test_each_dtype_gets_its_own_verdict(monkeypatch):
    """Under bf16 autocast the activations are bf16: that dtype is timed for itself, and a build that wins only in
    fp32 leaves bf16 on torch's."""
    model = _gpt2()
    monkeypatch.setattr(fused_gelu, "time_gelus", lambda rows, width, dtype, c: {
        **dict.fromkeys(c, 0.5 if dtype == torch.float32 else 2.0), "torch": 1.0})
    act, timings = fused_gelu.choose_gelu(model, 32, (torch.float32, torch.bfloat16), use_cache=False)
    assert list(act.builds) == [torch.float32] and any(k.startswith("bf16 ") for k in timings)
    x = torch.randn(4, 8).bfloat16()
    assert torch.equal(act(x), F.gelu(x, approximate="tanh"))

"""The training LayerNorm kernel: F.layer_norm's values and gradients (fp32, and bf16 output under autocast), installed
only into pre-norm blocks' norms and only where it times faster."""
import pytest
import torch
import torch.nn.functional as F

from seqlab.accel import accelerate, fused_layer_norm, restore_plain
from seqlab.accel.fused_layer_norm import FusedLayerNorm, block_norms
from seqlab.config import ModelConfig
from seqlab.model import build_model
from seqlab.runtime import native

ISAS = native.runnable_isas(fused_layer_norm.library)
pytestmark = pytest.mark.skipif(not ISAS, reason="no C compiler / AVX2 here")


def _run(norm, x, w, b, grad, dtype):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        y = norm(x, (x.shape[-1],), w, b, 1e-5)
    y.to(dtype).backward(grad)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(2, 7, 64), (33, 256), (1, 1, 768)])
def test_fp32_is_f_layer_norm(isa, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * 3 + 1
    w, b = torch.randn(shape[-1], generator=g), torch.randn(shape[-1], generator=g)
    grad = torch.randn(*shape, generator=g)
    want = _run(F.layer_norm, x, w, b, grad, torch.float32)
    got = _run(FusedLayerNorm({torch.float32: isa}), x, w, b, grad, torch.float32)
    assert got[0].dtype == torch.float32
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_under_autocast_is_the_norm_rounded_once(isa):
    """The output is F.layer_norm's rounded to bf16 (the linear layer's cast), the gradients those of norm + cast."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 50, 128, generator=g) * 2
    w, b = torch.randn(128, generator=g), torch.randn(128, generator=g)
    grad = torch.randn(3, 50, 128, generator=g).bfloat16()
    want = _run(F.layer_norm, x, w, b, grad, torch.bfloat16)
    got = _run(FusedLayerNorm({torch.bfloat16: isa}), x, w, b, grad, torch.bfloat16)
    assert got[0].dtype == torch.bfloat16 and want[0].dtype == torch.float32
    # one bf16 rounding of nearly equal fp32 values: equal, or one bf16 step apart
    assert (got[0].float() - want[0].bfloat16().float()).abs().le(want[0].abs() * 2**-7 + 1e-6).all()
    assert (got[0].float() == want[0].bfloat16().float()).float().mean() > 0.99
    for a, e in zip(got[1:], want[1:]):  # the backward is fp32 from the same bf16 gradient
        torch.testing.assert_close(a, e, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 3])
def test_any_thread_count_sums_the_weight_gradients(threads):
    """Each thread sums its rows' dw and db; the sums over threads must not depend on how many there are."""
    g = torch.Generator().manual_seed(2)
    x, grad = torch.randn(37, 64, generator=g), torch.randn(37, 64, generator=g)
    w, b = torch.randn(64, generator=g), torch.randn(64, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = _run(FusedLayerNorm({torch.float32: ISAS[0]}), x, w, b, grad, torch.float32)
    finally:
        torch.set_num_threads(before)
    want = _run(F.layer_norm, x, w, b, grad, torch.float32)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=2e-5, rtol=1e-5)


def test_a_second_derivative_fails_loudly():
    x = torch.randn(4, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    y = FusedLayerNorm({torch.float32: ISAS[0]})(x, (64,), w, None, 1e-5)
    with pytest.raises(RuntimeError, match="first order only"):  # a constant incoming gradient (once vanished)
        torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="first order only"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


def test_other_calls_go_to_torch():
    kernel = FusedLayerNorm({torch.float32: ISAS[0]})
    x = torch.randn(4, 20)  # a width no vector length divides: torch's
    w = torch.randn(20)
    torch.testing.assert_close(kernel(x, (20,), w, None, 1e-5), F.layer_norm(x, (20,), w, None, 1e-5), rtol=0, atol=0)
    xb = torch.randn(4, 32).bfloat16()  # a bf16 input (a bf16 model): torch's
    assert kernel(xb, (32,), w[:8].repeat(4).bfloat16(), None, 1e-5).dtype == torch.bfloat16


def _gpt2(pre_norm=True):
    return ModelConfig(arch="decoder", vocab_size=64, d_model=64, n_layers=2, n_heads=2, max_seq_len=32,
                       pos="learned", norm="layernorm", mlp="gelu", activation="gelu_tanh", bias=True,
                       pre_norm=pre_norm)


def test_only_pre_norm_block_norms_take_it():
    model = build_model(_gpt2())
    norms = block_norms(model)
    assert len(norms) == 4 and model.stack.norm not in norms
    assert block_norms(build_model(_gpt2(pre_norm=False))) == []


@pytest.mark.parametrize("kernel_s", [0.5, 0.97])  # twice as fast; 3 % faster, inside calibrate.MIN_GAIN
def test_accelerate_installs_it_only_where_faster_and_restore_takes_it_off(monkeypatch, kernel_s):
    model = build_model(_gpt2())
    monkeypatch.setattr(fused_layer_norm, "time_norms",
                        lambda rows, width, dtype, candidates, rounds=5: {k: 1.0 if k == "torch" else kernel_s
                                                                           for k in candidates})
    accelerate(model, "train", rows=64, dtype=None, use_cache=False)
    assert all(isinstance(m.normalize, FusedLayerNorm) == (kernel_s < 0.9) for m in block_norms(model))
    assert model.stack.norm.normalize is F.layer_norm
    restore_plain(model)
    assert all(m.normalize is F.layer_norm for m in block_norms(model))

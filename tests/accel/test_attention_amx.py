"""The AMX training attention: as close to fp32 arithmetic on its bf16 inputs as SDPA's own bf16 attention, values
and gradients, for the calls it takes; chosen by timing like the other builds, and never under an ISA cap."""
import pytest
import torch
import torch.nn.functional as F

from seqlab.accel import attention_amx
from seqlab.accel.train_attention import TrainAttention, choose_train_attention
from seqlab.config import ModelConfig
from seqlab.model import build_model
from seqlab.runtime import native

pytestmark = pytest.mark.skipif(not attention_amx.available(), reason="no AMX (bf16 tiles) on this CPU")


def _errors(B, H, G, T, D, seed=0):
    """Mean and max |error| of out and of the [B, T, H + 2G, D] input gradient, for SDPA in bf16 and for the kernel,
    against fp32 arithmetic on the same bf16 inputs and output gradient."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(B, T, H + 2 * G, D, generator=g) * 2).bfloat16()
    grad = torch.randn(B, H, T, D, generator=g).bfloat16()
    results = {}
    for name in ("fp32", "sdpa", "amx"):
        x = (qkv.float() if name == "fp32" else qkv.clone()).requires_grad_()
        q, k, v = (t.transpose(1, 2) for t in x.split((H, G, G), dim=2))
        if name == "amx":
            assert attention_amx.takes(q, k, v)
            out = attention_amx.causal_attention_amx(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != G)
        out.backward(grad.to(out.dtype))
        results[name] = (out.detach().float(), x.grad.float())
    ref = results.pop("fp32")
    return {name: [((got - want).abs().mean().item(), (got - want).abs().max().item())
                   for got, want in zip(pair, ref)] for name, pair in results.items()}


@pytest.mark.parametrize("B,H,G,T,D", [(2, 4, 4, 49, 64), (1, 9, 3, 97, 64), (3, 2, 1, 48, 32), (2, 3, 3, 300, 96),
                                       (1, 2, 2, 47, 32), (2, 2, 2, 16, 128), (1, 1, 1, 5, 32)])
def test_values_and_gradients_are_as_close_as_sdpas_bf16(B, H, G, T, D):
    """P and dS are rounded to bf16 as operands (SDPA's bf16 rounds its own intermediates): measured, the output's
    mean error is about 1.25x SDPA's and the gradients' the same as SDPA's; a wrong tile or mask is far off."""
    errors = _errors(B, H, G, T, D)
    for (sdpa_mean, sdpa_max), (amx_mean, amx_max) in zip(errors["sdpa"], errors["amx"]):
        assert amx_mean <= 1.5 * sdpa_mean + 1e-6
        assert amx_max <= 2.5 * sdpa_max + 1e-5


def test_one_token_is_exact():
    """One query sees one key: the output is V's row and the gradients are exact products."""
    errors = _errors(1, 2, 2, 1, 64)
    assert errors["amx"][0] == (0.0, 0.0)
    assert errors["amx"][1][1] < 1e-5


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_thread_count_gives_the_same_result(threads):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, 70, 6, 64, generator=g).bfloat16()
    grad = torch.randn(3, 4, 70, 64, generator=g).bfloat16()

    def run():
        x = qkv.clone().requires_grad_()
        q, k, v = (t.transpose(1, 2) for t in x.split((4, 1, 1), dim=2))
        out = attention_amx.causal_attention_amx(q, k, v)
        out.backward(grad)
        return out.detach(), x.grad

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = run()
        torch.set_num_threads(threads)
        got = run()
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_takes_only_what_it_was_built_for():
    q = torch.randn(1, 2, 8, 64).bfloat16()
    assert attention_amx.takes(q, q, q)
    assert not attention_amx.takes(q[..., :48], q[..., :48], q[..., :48])  # head width not a multiple of 32
    long = torch.randn(1, 1, attention_amx.MAX_LEN + 1, 32).bfloat16()
    assert not attention_amx.takes(long, long, long)
    odd = torch.randn(1, 2, 8, 65).bfloat16()[..., 1:]  # rows that start between 32-bit words
    assert not attention_amx.takes(odd, odd, odd)


def test_train_attention_routes_bf16_under_autocast_to_it(monkeypatch):
    calls = []
    real = attention_amx.causal_attention_amx
    monkeypatch.setattr(attention_amx, "causal_attention_amx", lambda *a: calls.append(1) or real(*a))
    attend = TrainAttention({torch.bfloat16: attention_amx.ISA})
    x = torch.randn(2, 16, 3, 2, 64, requires_grad=True)
    q, k, v = (t.transpose(1, 2) for t in x.unbind(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attend(q, k, v, is_causal=True)
    out.float().sum().backward()
    assert calls == [1] and out.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    attend(q, k, v, is_causal=True)  # fp32 outside autocast: SDPA
    assert calls == [1]


def test_calibration_times_it_for_bf16_only():
    cfg = ModelConfig(arch="decoder", vocab_size=64, d_model=128, n_layers=1, n_heads=2, max_seq_len=64)
    _, timings = choose_train_attention(build_model(cfg), 2, 64, (torch.float32, torch.bfloat16), use_cache=False)
    assert "bf16 amx" in timings and "fp32 amx" not in timings


def test_an_isa_cap_keeps_it_out(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert native.isa_allowed("amx") is not None and native.isa_allowed("avx512") is None
    assert attention_amx.library() is None
    assert not attention_amx.available()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    for var, value in {"DNNL_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx2"}.items():
        monkeypatch.setenv(var, value)
        assert native.isa_allowed("amx") is not None


def test_an_os_that_refuses_the_tile_state_leaves_the_build_absent(monkeypatch):
    """Where Linux refuses AMX to the process, the library is not offered (the other builds compete), with a
    warning, instead of failing at the first call."""
    monkeypatch.setattr(native, "_OPTIONAL", {})

    def refuse(dll):
        raise OSError("the OS did not grant this process AMX tile state")

    monkeypatch.setattr(attention_amx, "_signatures", refuse)
    with pytest.warns(RuntimeWarning, match="AMX tile state"):
        assert not attention_amx.available()
    cfg = ModelConfig(arch="decoder", vocab_size=64, d_model=128, n_layers=1, n_heads=2, max_seq_len=64)
    _, timings = choose_train_attention(build_model(cfg), 2, 64, (torch.bfloat16,), use_cache=False)
    assert "bf16 amx" not in timings and "bf16 sdpa" in timings

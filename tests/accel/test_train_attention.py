"""The training attention kernel: SDPA's values and gradients, only for the calls it was built for, and installed
by ``accelerate(for_="train")`` only where it measures faster."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from seqlab.accel import accelerate, restore_plain
from seqlab.accel import train_attention
from seqlab.accel.train_attention import TrainAttention, causal_attention_trained, trainable
from seqlab.config import ModelConfig
from seqlab.model import build_model
from seqlab.model.attention import SelfAttention

ISAS = train_attention.available_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="no C compiler / AVX2 here")


def _qkv(B, H, G, T, D, dtype=torch.float32, seed=0):
    """q [B, H, T, D], k and v [B, G, T, D] as views of one [B, T, H + 2G, D] projection (the model's layout)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(B, T, H + 2 * G, D, generator=g) * 2).to(dtype).requires_grad_()
    return qkv, lambda: [t.transpose(1, 2) for t in qkv.split((H, G, G), dim=2)]


def _sdpa_and_kernel(isa, B, H, G, T, D, dtype):
    qkv, views = _qkv(B, H, G, T, D, dtype)
    grad = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = []
    for fn in (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != G),
               lambda q, k, v: causal_attention_trained(q, k, v, isa=isa)):
        out = fn(*views())
        out.backward(grad)
        results.append((out.detach(), qkv.grad))
        qkv.grad = None
    return results


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("B,H,G,T,D", [(2, 4, 4, 49, 64), (1, 9, 3, 97, 64), (3, 2, 1, 48, 32), (1, 2, 2, 1, 64),
                                       (2, 3, 3, 300, 96), (1, 2, 2, 47, 32)])
def test_values_and_gradients_are_sdpas_in_fp32(isa, B, H, G, T, D):
    (want, want_grad), (got, got_grad) = _sdpa_and_kernel(isa, B, H, G, T, D, torch.float32)
    # fp32 rounding in another summation order (inputs of a few units, sums over up to 300 keys)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_grad, want_grad, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("B,H,G,T", [(1, 4, 1, 300), (1, 6, 3, 200), (3, 2, 1, 100)])
def test_fewer_kv_heads_than_threads_split_their_query_blocks(isa, threads, B, H, G, T):
    """Where the batch's kv heads do not share out evenly over the threads (MQA at batch 1), each kv head's query
    blocks are cut into slices whose dK and dV are summed at the end: still SDPA's gradients, at any thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        (want, want_grad), (got, got_grad) = _sdpa_and_kernel(isa, B, H, G, T, 64, torch.float32)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_grad, want_grad, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_is_computed_in_fp32_and_rounded_once(isa):
    """bf16 inputs are widened: output and gradients are fp32 attention's on the same (bf16-valued) inputs, each
    rounded to bf16 once at the end (so within a bf16 rounding of values of a few units)."""
    (_, _), (got, got_grad) = _sdpa_and_kernel(isa, 2, 4, 2, 70, 64, torch.bfloat16)
    qkv, views = _qkv(2, 4, 2, 70, 64, torch.bfloat16)
    wide = qkv.detach().float().requires_grad_()
    q, k, v = (t.transpose(1, 2) for t in wide.split((4, 2, 2), dim=2))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref.backward(torch.randn(2, 4, 70, 64, generator=torch.Generator().manual_seed(1)).bfloat16().float())
    assert got.dtype == torch.bfloat16 and got_grad.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=4e-3)
    torch.testing.assert_close(got_grad.float(), wide.grad, atol=2e-2, rtol=4e-3)


@pytest.mark.parametrize("isa", ISAS)
def test_any_gradient_layout_and_no_second_derivative(isa):
    qkv, views = _qkv(1, 2, 2, 33, 64)
    causal_attention_trained(*views(), isa=isa).sum().backward()  # a broadcast (zero-stride) output gradient
    got, qkv.grad = qkv.grad, None
    F.scaled_dot_product_attention(*views(), is_causal=True).sum().backward()
    torch.testing.assert_close(got, qkv.grad, atol=5e-5, rtol=1e-4)
    out = causal_attention_trained(*views(), isa=isa)
    with pytest.raises(RuntimeError, match="first order only"):  # the C backward builds no graph of the gradient
        torch.autograd.grad(out.sum(), qkv, create_graph=True)  # (a constant incoming gradient once vanished)


def test_only_the_calls_it_was_built_for_and_the_rest_on_sdpa(monkeypatch):
    attend = TrainAttention({torch.float32: ISAS[0]})
    qkv, views = _qkv(1, 2, 2, 16, 64)
    q, k, v = views()
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    assert trainable(q, k, v, None, 0.0, True)
    assert not trainable(q, k, v, mask, 0.0, False)  # a mask (left padding)
    assert not trainable(q, k, v, None, 0.1, True)  # dropout
    assert not trainable(q, k, v, None, 0.0, False)  # not causal (an encoder)
    assert not trainable(q[:, :, :1], k, v, None, 0.0, True)  # fewer queries than keys (a decode step)
    with torch.no_grad():
        assert not trainable(q, k, v, None, 0.0, True)  # nothing to train: evaluation stays on SDPA
    q2, k2, v2 = (t.detach()[..., :48].contiguous().requires_grad_() for t in (q, k, v))
    assert not trainable(q2, k2, v2, None, 0.0, True)  # a head width the tiles do not divide

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel took a call it was not built for")

    monkeypatch.setattr(train_attention, "causal_attention_trained", refuse)
    for args, kwargs in [((q, k, v), {"attn_mask": mask}), ((q, k, v), {"is_causal": False}),
                         ((q.double(), k.double(), v.double()), {"is_causal": True})]:
        got = attend(*args, **kwargs)
        torch.testing.assert_close(got, F.scaled_dot_product_attention(*args, **kwargs))


def _llama(seed=0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(vocab_size=97, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                                   max_seq_len=64))


def _grads(model, ids, recompute=False):
    model.zero_grad(set_to_none=True)
    out = checkpoint(model, ids, use_reentrant=False) if recompute else model(ids)
    out.float().square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _count_kernel_calls(monkeypatch) -> list[int]:
    calls = []
    apply = train_attention._CausalAttention.apply
    monkeypatch.setattr(train_attention._CausalAttention, "apply", lambda *a: calls.append(1) or apply(*a))
    return calls


def test_accelerate_installs_it_only_where_it_wins_and_gradients_stay_the_plain_models(monkeypatch):
    ids = torch.randint(0, 97, (3, 60), generator=torch.Generator().manual_seed(2))
    plain, model = _llama(), _llama()
    timed, calls = [], _count_kernel_calls(monkeypatch)

    def fast(n_heads, n_kv, head_dim, batch, length, dtype, candidates):
        timed.append((n_heads, n_kv, head_dim, batch, length, dtype))
        return {**dict.fromkeys(candidates, 0.5), "sdpa": 1.0}

    monkeypatch.setattr(train_attention, "time_train_attention", fast)
    accelerate(model, "train", rows=3 * 60, dtype="fp32", budget_s=0.2, seq_len=60)
    assert timed[0][:5] == (4, 2, 32, 3, 60)  # the model's heads, the step's batch and length
    assert all(isinstance(m.attend, TrainAttention) for m in model.modules() if isinstance(m, SelfAttention))
    assert "causal attention" in model.accel_plan.summary() and "seqlab's kernel" in model.accel_plan.train_attention
    want = _grads(plain, ids)
    for recompute, runs in ((False, 2), (True, 4)):  # activation recomputation reruns the kernel's forward
        calls.clear()
        got = _grads(model, ids, recompute)
        assert len(calls) == runs  # the kernel ran in both layers (and again in the recomputation)
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=2e-5, rtol=1e-4)
    restore_plain(model)
    assert all(m.attend is F.scaled_dot_product_attention for m in model.modules() if isinstance(m, SelfAttention))

    slow = _llama(1)  # a kernel made slower than SDPA is not chosen
    monkeypatch.setattr(train_attention, "time_train_attention",
                        lambda *a: {**dict.fromkeys(a[-1], 2.0), "sdpa": 1.0})
    accelerate(slow, "train", rows=2 * 32, dtype="fp32", budget_s=0.2, seq_len=32)
    assert all(m.attend is F.scaled_dot_product_attention for m in slow.modules() if isinstance(m, SelfAttention))
    assert slow.accel_plan.train_attention == "" and "SDPA runs" in slow.accel_plan.summary()


def test_timing_runs_every_candidate_forward_and_backward():
    candidates = {"sdpa": F.scaled_dot_product_attention, ISAS[0]: TrainAttention({torch.float32: ISAS[0]})}
    timings = train_attention.time_train_attention(2, 1, 32, 2, 40, torch.float32, candidates)
    assert set(timings) == set(candidates) and all(0 < t < 1 for t in timings.values())


def test_under_autocast_a_rotary_models_mixed_dtypes_reach_the_kernel(monkeypatch):
    """Under bf16 autocast a rotary model's queries and keys come out of the rotation in fp32 and its values in
    bf16; SDPA would compute in bf16. The kernel widens all three, so its gradients sit nearer fp32's."""
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    plain, model = _llama(), _llama()
    train_attention.install(model, TrainAttention({torch.bfloat16: ISAS[0]}))
    calls = _count_kernel_calls(monkeypatch)
    exact = _grads(plain, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, sdpa = _grads(model, ids), _grads(plain, ids)
    assert len(calls) == 2
    for name in exact:
        err = (got[name] - exact[name]).norm() / exact[name].norm()
        assert err < 0.05 and err <= 1.5 * (sdpa[name] - exact[name]).norm() / exact[name].norm() + 1e-3, name

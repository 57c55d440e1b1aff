"""The fused summed cross-entropy of token_cross_entropy equals F.cross_entropy, loss and gradient."""
import pytest
import torch
import torch.nn.functional as F

from seqlab.objectives import IGNORE_INDEX, token_cross_entropy


def _reference(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_matches_cross_entropy_with_ignored_positions(scale):
    torch.manual_seed(0)
    logits = torch.randn(3, 11, 50) * 4
    labels = torch.randint(0, 50, (3, 11))
    labels[0, -1] = labels[2, :3] = IGNORE_INDEX
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss, n = token_cross_entropy(a, labels)
    ref = _reference(b, labels)
    assert n == 29
    assert torch.allclose(loss, ref, rtol=1e-6, atol=1e-4)
    (loss * scale).backward()
    (ref * scale).backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-7, rtol=1e-5)
    assert a.grad[2, :3].abs().max() == 0  # ignored positions get no gradient


def test_targets_far_below_the_best_logit_stay_exact():
    """softmax underflows to 0 there; the loss must still be the exact -log_softmax, not inf."""
    logits = torch.zeros(2, 4, 30)
    logits[0, 1, 5] = -200.0
    logits[1, 2, 7] = -1e4
    labels = torch.zeros(2, 4, dtype=torch.long)
    labels[0, 1], labels[1, 2] = 5, 7
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss, _ = token_cross_entropy(a, labels)
    ref = _reference(b, labels)
    assert torch.isfinite(loss) and torch.allclose(loss, ref, rtol=1e-6)
    loss.backward()
    ref.backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-7)


def test_a_second_backward_through_the_same_graph_is_refused():
    logits = torch.randn(4, 9, requires_grad=True)
    loss, _ = token_cross_entropy(logits, torch.randint(0, 9, (4,)))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass"):
        loss.backward()


def test_bf16_logits_give_the_fp32_loss_and_autocasts_gradient():
    """Under bf16 autocast the head's logits are bf16: the fused CE reads them as they are (softmax in fp32) and
    returns a bf16 gradient, as autocast's cast back to bf16 would, without the fp32 copy of the logits."""
    torch.manual_seed(1)
    logits = (torch.randn(6, 13, 300) * 3).bfloat16()
    labels = torch.randint(0, 300, (6, 13))
    labels[1, :4] = IGNORE_INDEX
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss, n = token_cross_entropy(a, labels)
    ref = _reference(b.float(), labels)  # what F.cross_entropy on the upcast logits gives
    assert n == 74 and loss.dtype == torch.float32
    assert torch.allclose(loss, ref, rtol=1e-6, atol=1e-4)
    (loss * 0.5).backward()
    (ref * 0.5).backward()
    assert a.grad.dtype == torch.bfloat16
    # one bf16 rounding of softmax - onehot, then the scale: within a bf16 ulp of autocast's gradient
    torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=2e-3, rtol=1e-2)
    assert a.grad[1, :4].abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steps_reuse_the_gradient_buffer_without_clobbering_a_held_one(dtype):
    """The softmax / gradient tensors come from a pool and are handed to the next step once free; a gradient that
    something still holds (a hook here) must keep its values when the next step runs."""
    torch.manual_seed(2)
    held = []
    first = torch.randn(1, 5, 40, dtype=dtype, requires_grad=True)
    h = first * 1.0
    h.register_hook(lambda g: held.append(g))  # keeps the logits' gradient (a view of the pooled one) alive
    labels = torch.randint(0, 40, (1, 5))
    token_cross_entropy(h, labels)[0].backward()
    kept = held[0].clone()
    for _ in range(2):  # later steps of the same shape
        nxt = torch.randn(5, 40, dtype=dtype, requires_grad=True)
        loss, _ = token_cross_entropy(nxt, torch.randint(0, 40, (5,)))
        loss.backward()
        assert held[0].data_ptr() != nxt.grad.data_ptr()
    assert torch.equal(held[0], kept)


def test_a_free_gradient_buffer_is_reused():
    from seqlab.objectives import loss as loss_module

    ptrs = []
    for _ in range(3):
        logits = torch.randn(6, 30, requires_grad=True)
        out = logits * 1.0
        token_cross_entropy(out, torch.randint(0, 30, (6,)))[0].backward()
        ptrs.append(loss_module._SCRATCH.take((6, 30), torch.float32).data_ptr())
    assert len(set(ptrs)) == 1

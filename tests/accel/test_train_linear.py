"""TrainLinear: the oneDNN training route computes what nn.Linear computes, and steps aside where it must."""
import pytest
import torch
import torch.nn.functional as F

from seqlab.accel.train_linear import TrainLinear, _onednn_linear_op, uses_onednn

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")


def _pair(i: int, o: int, bias: bool, wgrad: bool = False, igrad: bool = True):
    torch.manual_seed(0)
    ref = torch.nn.Linear(i, o, bias=bias)
    ours = TrainLinear(torch.nn.Linear(i, o, bias=bias), wgrad_onednn=wgrad, igrad_onednn=igrad)
    ours.load_state_dict(ref.state_dict())
    return ours, ref


@pytest.mark.parametrize("i,o,bias,wgrad,igrad", [(48, 80, True, False, True), (40, 24, False, False, True),
                                                  (16, 200, True, True, True), (40, 24, False, True, True),
                                                  (48, 80, True, False, False), (40, 24, False, False, False)])
def test_forward_and_gradients_match_nn_linear(i, o, bias, wgrad, igrad):
    # same products, another summation order: fp32 agreement to a few ulps of the ~1e-1-sized values, atol 1e-5
    # (igrad=False: the onednn-forward route, both gradients on MKL)
    ours, ref = _pair(i, o, bias, wgrad, igrad)
    x = torch.randn(3, 7, i)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    assert uses_onednn(xa, ours.weight, ours.bias)
    ya, yb = ours(xa), ref(xb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.allclose(ya, yb, atol=1e-5, rtol=1e-5)
    assert torch.allclose(xa.grad, xb.grad, atol=1e-5, rtol=1e-5)
    assert torch.allclose(ours.weight.grad, ref.weight.grad, atol=1e-5, rtol=1e-5)
    assert ours.weight.grad.is_contiguous()
    if bias:
        assert torch.allclose(ours.bias.grad, ref.bias.grad, atol=1e-5, rtol=1e-5)


def test_non_contiguous_input_and_frozen_weight():
    ours, ref = _pair(32, 24, True)
    ours.weight.requires_grad_(False)
    base = torch.randn(32, 10, requires_grad=True)
    base2 = base.detach().clone().requires_grad_()
    ours(base.t()).square().sum().backward()
    ref(base2.t()).square().sum().backward()
    assert torch.allclose(base.grad, base2.grad, atol=1e-5, rtol=1e-5)
    assert ours.weight.grad is None and ours.bias.grad is not None


def test_stock_path_where_onednn_does_not_apply():
    lin = TrainLinear(torch.nn.Linear(8, 4))
    x = torch.randn(2, 8, requires_grad=True)
    with torch.no_grad():
        assert not uses_onednn(x, lin.weight, lin.bias)  # inference: the packed route's job, not this one's
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not uses_onednn(x, lin.weight, lin.bias)  # autocast must see F.linear to cast it
        assert lin(x).dtype == torch.bfloat16
    bf = torch.nn.Linear(8, 4).to(torch.bfloat16)
    assert not uses_onednn(x.to(torch.bfloat16), bf.weight, bf.bias)
    assert not uses_onednn(torch.randn(2, 8), lin.weight.detach(), None)  # nothing to differentiate


def test_custom_op_registration_is_sound():
    """The op torch.compile sees: schema, fake (meta) shapes and eager results agree."""
    x, w, b = torch.randn(5, 8), torch.randn(6, 8), torch.randn(6)
    torch.library.opcheck(_onednn_linear_op, (x, w, b), test_utils=("test_schema", "test_faketensor"))
    assert torch.allclose(_onednn_linear_op(x, w, b), F.linear(x, w, b), atol=1e-5)

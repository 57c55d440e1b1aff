"""``TrainLinear``: an ``nn.Linear``'s parameters, with the fp32 CPU training products on oneDNN instead of MKL.

Why: PyTorch sends fp32 CPU matrix products to MKL; on some CPUs oneDNN's JIT kernels run a training step's
forward product and input gradient faster on the same shapes, and for some shapes (LM heads: out >> in) the weight
gradient too. Which library wins depends on the CPU and the shape, so :mod:`seqlab.accel.calibrate` times both
routes (``onednn-train``: weight gradient on MKL; ``onednn-train-wgrad``: weight gradient on oneDNN too;
``onednn-forward``: both gradients on MKL) against plain ``F.linear`` on this machine and keeps a route only where it
is faster.

Only plain fp32 CPU tensors take this path, and only while autograd records (training): under autocast,
``torch.compile``, on GPU, in other dtypes, or without gradients, ``TrainLinear`` is exactly ``nn.Linear``. The
products are the same mathematics with a different summation order, so results agree with ``F.linear`` to fp32
rounding (~1e-6 relative), not bitwise. The module shares the original layer's ``Parameter`` objects, so an
optimizer built before the conversion keeps working and the state dict is unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = _onednn_available()


@torch.library.custom_op("seqlab::onednn_linear", mutates_args=())
def _onednn_linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_onednn_linear_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` by oneDNN; ``weight`` may be a strided view (a transpose is read in place).

    Under ``torch.compile`` the product goes through an opaque custom op: Inductor's own lowering of oneDNN's
    linear only accepts weights it packed itself.
    """
    if torch.compiler.is_compiling():
        return _onednn_linear_op(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDNNLinearFn(torch.autograd.Function):
    """Forward on oneDNN; input gradient and weight gradient each on oneDNN or MKL (``igrad_onednn``,
    ``wgrad_onednn``)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, wgrad_onednn: bool,
                igrad_onednn: bool = True) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        ctx.in_shape = x.shape
        ctx.wgrad_onednn = wgrad_onednn
        ctx.igrad_onednn = igrad_onednn
        return onednn_linear(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x2, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        if not g.is_contiguous():
            g = g.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (onednn_linear(g, weight.t()) if ctx.igrad_onednn else g.mm(weight)).view(ctx.in_shape)
        if ctx.needs_input_grad[1]:
            if ctx.wgrad_onednn:  # oneDNN forms the transposed gradient x^T g
                grad_w = onednn_linear(x2.t(), g.t()).t().contiguous()
            else:
                grad_w = g.t().mm(x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None, None


def _plain(t: Tensor | None) -> bool:
    # exact types only: tensor subclasses (DTensor, fake or functional tensors) keep the stock path
    return t is None or type(t) in (Tensor, nn.Parameter)


def plain_fp32_product(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether oneDNN may take ``F.linear(x, weight, bias)``: non-empty plain fp32 CPU tensors, outside autocast
    (shared by the training route here and the prefill's route, ``seqlab.accel.prefill``)."""
    return (_ONEDNN and x.numel() > 0 and not torch.is_autocast_enabled("cpu")
            and all(_plain(t) and (t is None or (t.dtype == torch.float32 and t.device.type == "cpu"
                                                 and t.layout == torch.strided)) for t in (x, weight, bias)))


def uses_onednn(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether :class:`TrainLinear` sends this product to oneDNN (the conditions in the module docstring)."""
    return (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            and plain_fp32_product(x, weight, bias))


def onednn_train_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, wgrad_onednn: bool = False,
                        igrad_onednn: bool = True) -> Tensor:
    """``F.linear`` with the oneDNN training path where :func:`uses_onednn` holds."""
    if uses_onednn(x, weight, bias):
        return _OneDNNLinearFn.apply(x, weight, bias, wgrad_onednn, igrad_onednn)
    return F.linear(x, weight, bias)


def train_route_available() -> bool:
    return _ONEDNN


class TrainLinear(nn.Module):
    """An ``nn.Linear``'s own parameters (shared, not copied) with :func:`onednn_train_linear` as its product."""

    def __init__(self, linear: nn.Linear, wgrad_onednn: bool = False, igrad_onednn: bool = True):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.wgrad_onednn = wgrad_onednn
        self.igrad_onednn = igrad_onednn

    def forward(self, x: Tensor) -> Tensor:
        return onednn_train_linear(x, self.weight, self.bias, self.wgrad_onednn, self.igrad_onednn)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"igrad_onednn={self.igrad_onednn}, wgrad_onednn={self.wgrad_onednn}")

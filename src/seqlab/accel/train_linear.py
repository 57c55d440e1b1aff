"""``Linear``: ``nn.Linear`` whose fp32 CPU training products run on oneDNN where that is the faster library.

Why: PyTorch sends fp32 CPU matrix products to MKL. On the AMD EPYC we develop on, MKL runs the products of a
training step's forward pass and input gradient well below what oneDNN's JIT kernels reach on the same shapes:
the GPT-2-shaped LM head's forward (2048 x 256 x 8192) takes 172 ms with MKL and 124 ms with oneDNN, and the
layers' products are 15-40 % faster too. The weight gradient (``dY^T X``) is mostly the exception: MKL is as fast
or faster there except for LM-head shapes, so it stays on MKL otherwise. ``bench/train_throughput.py`` prints the
per-product table (``--gemm-table``).

Only plain fp32 CPU tensors take this path, and only while autograd records (training): under autocast,
``torch.compile``, on GPU, in other dtypes, or without gradients, ``Linear`` is exactly ``nn.Linear``. Inference
on CPU has its own, faster route (:mod:`seqlab.model.packing`). The products are the same mathematics with a
different summation order, so results agree with ``F.linear`` to fp32 rounding (~1e-6 relative), not bitwise.
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


def _onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` by oneDNN; ``weight`` may be a strided view (a transpose is read in place).

    Under ``torch.compile`` the product goes through an opaque custom op: Inductor's own lowering of oneDNN's
    linear only accepts weights it packed itself.
    """
    if torch.compiler.is_compiling():
        return _onednn_linear_op(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# weight gradient of a layer with out_features >= _WIDE * in_features goes to oneDNN (measured: 2048 x 256 -> 8192
# LM head, 96 ms against MKL's 109 ms; at out = 4 x in MKL is still the faster one)
_WIDE = 8


class _OneDNNLinearFn(torch.autograd.Function):
    """Forward and input gradient on oneDNN, weight gradient on MKL (the faster library for each product)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        ctx.in_shape = x.shape
        return _onednn_linear(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x2, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        if not g.is_contiguous():
            g = g.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_linear(g, weight.t()).view(ctx.in_shape)
        if ctx.needs_input_grad[1]:
            if weight.shape[0] >= _WIDE * weight.shape[1]:
                # LM-head shapes (out >> in): oneDNN forms the transposed gradient x^T g faster than MKL forms g^T x
                grad_w = _onednn_linear(x2.t(), g.t()).t().contiguous()
            else:
                grad_w = g.t().mm(x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b


def _plain(t: Tensor | None) -> bool:
    # exact types only: tensor subclasses (DTensor, fake or functional tensors) keep the stock path
    return t is None or type(t) in (Tensor, nn.Parameter)


def uses_onednn(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether :class:`Linear` sends this product to oneDNN (the conditions in the module docstring)."""
    return (_ONEDNN and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32) and x.numel() > 0
            and _plain(x) and _plain(weight) and _plain(bias)
            and not torch.is_autocast_enabled("cpu"))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` with the oneDNN training path of :class:`Linear`."""
    if uses_onednn(x, weight, bias):
        return _OneDNNLinearFn.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state dict and init) with :func:`linear`'s faster fp32 CPU training path."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

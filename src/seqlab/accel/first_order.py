"""The C kernels' backward passes are first order: a second derivative through them must fail, not vanish.

``torch.autograd.function.once_differentiable`` is not enough on its own: it marks the gradient as
non-differentiable only when the incoming gradient requires grad. For ``grad(f(x).sum(), x, create_graph=True)``
that gradient is a constant, so the kernel's contribution to the second derivative silently went missing (the
fused GELU's second derivative came out without GELU's own term). The backward runs with grad mode on exactly when
a graph of the gradient is being built, so that is where it refuses.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def first_order_only(kernel: str) -> Callable[[Callable], Callable]:
    """Decorate an ``autograd.Function.backward`` whose kernel builds no graph of its gradient."""
    def wrap(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(f"seqlab.accel: the {kernel} kernel's gradient is first order only; for a second "
                                   "derivative (create_graph=True) use the plain model (seqlab.accel.restore_plain)")
            return backward(ctx, *grads)
        return checked
    return wrap

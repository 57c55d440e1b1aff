"""Undo :func:`seqlab.accel.accelerate`: the plain model back, with nothing of the accelerator left on it.

Why its own module: ``accelerate`` also puts the plain layers back by itself, when the whole-pass check finds the
converted ones slower; both paths must restore exactly the same way.
"""

from __future__ import annotations

from torch import nn

from seqlab.accel.fused_gelu import uninstall as uninstall_gelu
from seqlab.accel.fused_layer_norm import uninstall as uninstall_norm
from seqlab.accel.packed_linear import PackedLinear
from seqlab.accel.pointwise import uninstall as uninstall_pointwise
from seqlab.accel.prefill import uninstall as uninstall_routing
from seqlab.accel.prefill_attention import uninstall as uninstall_attention
from seqlab.accel.train_linear import TrainLinear


def restore_plain(model: nn.Module) -> nn.Module:
    """Undo :func:`accelerate` in place: every accelerated layer back to a plain ``nn.Linear`` (trainable as it
    was; a packed one's Parameters are new, so build an optimizer after this), the installed prefill routes, fused
    step and plan removed, and a model that a bf16 plan cast back in the dtype it had (its values keep bf16's
    rounding: keep a copy of the model to return to the exact fp32 weights)."""
    restore_plain_layers(model)
    plain_dtype = model.__dict__.pop("accel_plain_dtype", None)
    if plain_dtype is not None:
        model.to(plain_dtype)
    uninstall_gelu(model)
    uninstall_norm(model)
    uninstall_pointwise(model)
    uninstall_attention(model)
    uninstall_routing(model)
    for attr in ("accel_plan", "fused_decode", "prefill_cast", "prefill_attention", "cross_entropy_kernel"):
        if attr in model.__dict__:
            delattr(model, attr)
    return model


def restore_plain_layers(model: nn.Module) -> None:
    for name, m in list(model.named_modules()):
        if isinstance(m, (PackedLinear, TrainLinear)):
            plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
            if isinstance(m, TrainLinear):
                plain.weight, plain.bias = m.weight, m.bias  # the same Parameters: optimizers keep working
            else:  # new Parameters (the packed layer kept no dense one), trainable as they were before packing
                plain.weight = nn.Parameter(m.weight, requires_grad=m.trainable[0])
                plain.bias = None if m.bias is None else nn.Parameter(m.bias.detach(), requires_grad=m.trainable[1])
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, plain)

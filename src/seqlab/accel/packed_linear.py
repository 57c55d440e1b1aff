"""Inference-only weight packing: linear layers whose weights live in oneDNN's blocked layout (CPU, fp32 or bf16).

Why: a decode step is a chain of matrix-vector products (or, for a batch of B rows, matrix products with only B
rows), so its speed is how fast the weights stream through the cores. On x86 CPUs the default path,
``F.linear`` -> MKL, streams a row-major ``[out, in]`` weight at well under the memory bandwidth for such thin
products (on the AMD EPYC we develop on: about 60 % of the bandwidth at one row, and far worse at eight rows).
oneDNN reorders the weight once into a blocked layout chosen for the expected number of rows, which is often faster
for such products; whether it is on this machine is measured, not assumed (:mod:`seqlab.accel.calibrate`).

The packed weight replaces the dense one (no extra memory), so a packed model is for inference only: oneDNN's
product has no autograd formula, and :class:`PackedLinear` refuses inputs that need gradients rather than
return silently wrong ones. ``state_dict`` still holds ordinary dense weights (unpacked on the fly), so saving a
packed model loses nothing, and loading a state dict into one repacks it.
"""
from __future__ import annotations

import itertools
import weakref

import torch
from torch import Tensor, nn


def packing_available(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> bool:
    """True when this torch build can pack weights of ``dtype`` on ``device`` (fp32, or bf16 where oneDNN has it)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


# torch.compile cannot trace oneDNN's opaque packed tensors, so a compiled graph calls packed layers through an
# opaque custom op that names the layer by an integer handle (a constant to the compiler) instead. The table
# holds weak references only: it never keeps a layer alive, and a model that is never packed never touches it.
_LIVE: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


@torch.library.custom_op("seqlab::packed_linear", mutates_args=())
def _packed_linear_op(x: Tensor, handle: int, out_features: int) -> Tensor:
    layer = _LIVE[handle]
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")


@_packed_linear_op.register_fake
def _(x: Tensor, handle: int, out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


class PackedLinear(nn.Module):
    """``nn.Linear`` for inference, its weight reordered by oneDNN for products with about ``rows_hint`` rows."""

    def __init__(self, linear: nn.Linear | PackedLinear, rows_hint: int = 1):
        super().__init__()
        self.handle = next(_HANDLES)
        _LIVE[self.handle] = self
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.rows_hint = int(rows_hint)
        # which of weight and bias trained before packing: restore_plain gives that back (packed, neither can)
        self.trainable = getattr(linear, "trainable", None) or (
            linear.weight.requires_grad, linear.bias is not None and linear.bias.requires_grad)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.packed = self._pack(linear.weight.detach())  # a PackedLinear's .weight is its unpacked copy

    def __deepcopy__(self, memo) -> PackedLinear:
        """A copy with its own packed weight, bias and handle (a field-by-field copy would share the handle)."""
        new = PackedLinear(self, self.rows_hint)
        if new.bias is not None:
            new.bias = nn.Parameter(new.bias.detach().clone(), requires_grad=False)
        new.train(self.training)
        memo[id(self)] = new
        return new

    def _pack(self, weight: Tensor) -> Tensor:
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {tuple(weight.shape)} does not fit a "
                             f"{self.in_features} -> {self.out_features} linear layer")
        dtype = weight.dtype if weight.dtype == torch.bfloat16 else torch.float32
        return torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype).contiguous(), self.rows_hint)

    def forward(self, x: Tensor) -> Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("this model's linear weights are packed for inference (seqlab.accel); "
                               "gradients cannot flow through them. Train an unpacked model.")
        if torch.compiler.is_compiling():
            return _packed_linear_op(x, self.handle, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def weight(self) -> Tensor:
        """The dense ``[out, in]`` weight, unpacked (a copy: for inspection and saving, not for speed)."""
        return self.packed.to_dense()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if key in state_dict:
            try:
                self.packed = self._pack(state_dict[key])
            except ValueError as e:
                error_msgs.append(f"{key}: {e}")
        elif strict:
            missing_keys.append(key)
        if self.bias is not None:
            bkey = prefix + "bias"
            if bkey in state_dict:
                with torch.no_grad():
                    self.bias.copy_(state_dict[bkey])
            elif strict:
                missing_keys.append(bkey)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"rows_hint={self.rows_hint}")


def pack_for_inference(model: nn.Module, rows_hint: int = 1) -> int:
    """Replace every fp32/bf16 CPU ``nn.Linear`` in ``model`` by a :class:`PackedLinear`, in place; return how many.

    ``rows_hint`` is the number of rows a decode step multiplies (the batch size, or the number of beams); oneDNN
    picks its blocking for it, but any row count works. Layers already packed for another ``rows_hint`` are
    repacked. Returns 0 (and changes nothing) where packing is not available. A tied LM head is packed as its own
    copy; the embedding keeps the dense matrix for lookups.
    """
    def wanted(m: nn.Module) -> bool:
        if isinstance(m, PackedLinear):
            return m.rows_hint != rows_hint
        return type(m) is nn.Linear and packing_available(m.weight.dtype, m.weight.device)

    # names, not modules: each dense layer must be freed as soon as its packed copy exists (peak memory ~ one layer)
    targets = [name for name, m in model.named_modules() if wanted(m)]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(getattr(parent, child), rows_hint))
    return len(targets)


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())

"""Turn a seqlab model's linear layers into quantised ones, from outside (the model file stays plain).

``quantize(model, bits=4, group_size=64)`` replaces every ``nn.Linear`` of a plain model (quantise before
:func:`seqlab.accel.accelerate`) by a :class:`QuantLinear`; the LM head gets ``lm_head_bits`` (int8 in groups
of 32 by default: the head's errors reach every logit directly). A token table tied to the head becomes a
:class:`QuantEmbedding` reading the head's rows, so the tie survives and the table is stored once, quantised.
The layout (which layer got which scheme) is recorded in ``model.config.extra["quant"]`` so a saved model can be
rebuilt with :func:`apply_layout` before its tensors are loaded.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from seqlab.model.layers import Rotary
from seqlab.quant.linear import QuantEmbedding, QuantLinear
from seqlab.quant.schemes import INT4_GROUP_SIZES, INT8_GROUP_SIZES, Scheme

_LINEARS = (nn.Linear,)
LM_HEAD = "lm_head.proj"


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _tied_embeddings(model: nn.Module, weight) -> list[str]:
    return [name for name, m in model.named_modules(remove_duplicate=False)
            if isinstance(m, nn.Embedding) and m.weight is weight]


INT8_GROUP = 32  # Q8_0's block: one scale per 32 weights


def default_group_size(bits: int, in_features: int) -> int:
    """int4: groups of 64. int8: groups of 32 where they divide the row, else one scale per row.

    Why int8 is grouped by default: one scale per row lets a single large weight coarsen the whole row's step;
    groups of 32 cost one bit more per weight and keep perplexity much closer to the original (docs/quantization.md).
    """
    if bits == 4:
        return 64
    return INT8_GROUP if in_features % INT8_GROUP == 0 else 0


def quantize(model: nn.Module, bits: int = 8, group_size: int | None = None, lm_head_bits: int = 8,
             lm_head_group_size: int | None = None) -> nn.Module:
    """Quantise every linear layer of ``model`` in place (weight-only) and return it, in eval mode.

    ``group_size``: int4 32/64/128 (default 64); int8 0 (one scale per output channel) or 32/64/128 (default 32
    where it divides the layer's inputs, else per channel). The LM head gets int8 at ``lm_head_group_size``
    (same default). A layer the scheme cannot take (group size not dividing ``in_features``) raises ValueError
    naming it, before anything is changed.
    """
    if bits not in (4, 8):
        raise ValueError(f"unsupported bit width {bits!r} (supported: the integers 8 and 4)")
    if is_quantized(model):  # it has no nn.Linear left: "quantising" it again would only erase its recorded layout
        raise ValueError("this model is already quantised; quantise the dense model")
    if getattr(model, "accel_plan", None) is not None:
        raise ValueError("quantize a plain model: this one carries CPU routes (seqlab.accel.restore_plain first)")
    head_bits = min(lm_head_bits, 8) if bits == 8 else lm_head_bits

    def scheme_for(name: str, in_features: int) -> Scheme:
        b, g = (head_bits, lm_head_group_size) if name == LM_HEAD else (bits, group_size)
        return Scheme(b, default_group_size(b, in_features) if g is None else int(g))

    targets = [(name, m) for name, m in model.named_modules() if type(m) in _LINEARS]
    plan = {name: scheme_for(name, m.in_features) for name, m in targets}
    for name, m in targets:  # validate all before changing anything
        try:
            plan[name].check(m.in_features, name)
        except ValueError as e:
            raise ValueError(f"{e}{_fitting_size_hint(bits, [m.in_features for n, m in targets if n != LM_HEAD])}") \
                from None
    tied: dict[str, list[str]] = {}
    layout = {}
    for name, m in targets:
        weight = m.weight.detach()
        embeds = _tied_embeddings(model, m.weight)
        bias = None if m.bias is None else m.bias.detach()
        q = QuantLinear.from_weight(weight, plan[name], bias, name)
        _set(model, name, q)
        for e in embeds:
            _set(model, e, QuantEmbedding(q))
        if embeds:
            tied[name] = embeds
        layout[name] = {"bits": q.bits, "group_size": q.group_size, "bias": bias is not None}
    record_layout(model, layout, tied)
    return model.eval()


def _fitting_size_hint(bits: int, in_features: list[int]) -> str:
    """``"; --group-size 32 fits every layer"``: the largest group size every layer of ``bits`` takes, or ""."""
    every = [g for g in reversed(INT4_GROUP_SIZES if bits == 4 else INT8_GROUP_SIZES)
             if all(_fits(Scheme(bits, g), k) for k in in_features)]
    if not every:
        return ""
    size = every[0]
    return f"; --group-size {size} fits every layer" + (" (one scale per output channel)" if size == 0 else "")


def _fits(scheme: Scheme, in_features: int) -> bool:
    try:
        scheme.check(in_features)
        return True
    except ValueError:
        return False


def describe_layout(layers: dict[str, dict]) -> str:
    """``"120 layers int4 in groups of 32, 1 layer int8 in groups of 32 (the LM head)"``: the schemes a quantised model's
    layers got (``config.extra["quant"]["layers"]``), so one figure does not hide a per-channel or int8 layer."""
    counts = Counter((int(spec["bits"]), int(spec["group_size"]), name == LM_HEAD) for name, spec in layers.items())
    parts = []
    for (bits, group, head), n in sorted(counts.items(), key=lambda kv: (kv[0][2], -kv[1])):
        groups = "one scale per output channel" if group == 0 else f"groups of {group}"
        parts.append(f"{n} layer{'s' if n > 1 else ''} int{bits} in {groups}" + (" (the LM head)" if head else ""))
    return ", ".join(parts)


def model_layout(model: nn.Module) -> str | None:
    """:func:`describe_layout` of the layout a quantised model recorded (a `seqlab quantize` folder, or quantised on
    load); None for a dense model."""
    stored = model.config.extra.get("quant")
    return describe_layout(stored["layers"]) if stored else None


def record_layout(model: nn.Module, layers: dict[str, dict], tied: dict[str, list[str]]) -> None:
    """Record the quantised layout in the model's config (saved with it), and freeze what stays in floating point
    (norms, biases): a quantised model is for inference, so a plain forward outside ``no_grad`` must run, and only
    an attempt to train reaches QuantLinear's refusal."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "extra"):
        cfg.extra = {**cfg.extra, "quant": {"layers": layers, "tied_embeddings": tied}}
    model.requires_grad_(False)


def apply_layout(model: nn.Module, layout: dict) -> nn.Module:
    """Give a freshly built model the quantised structure in ``layout`` (empty buffers, to be loaded)."""
    try:
        layers, tied = layout["layers"], layout.get("tied_embeddings", {})
        for name, spec in layers.items():
            m = model.get_submodule(name)
            q = QuantLinear(m.in_features, m.out_features, Scheme(int(spec["bits"]), int(spec["group_size"])),
                            bool(spec["bias"]), name)
            _set(model, name, q)
            for e in tied.get(name, []):
                _set(model, e, QuantEmbedding(q))
    except (KeyError, AttributeError, TypeError) as e:
        raise ValueError(f"quantisation layout does not fit the model: {e}") from e
    record_layout(model, layers, tied)
    return model


def cast_unquantised(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """``model`` with the float tensors outside its quantised layers in ``dtype`` (None: left as they are).

    Why not ``model.to(dtype)`` before quantising: int8/int4 must round the fp32 weights (a bf16 copy put 452 of a
    layer's 8192 elements past half a step); and after it, ``.to`` would round the quantised layers' scales too.
    """
    if dtype is None:
        return model
    for m in model.modules():
        if not isinstance(m, (QuantLinear, QuantEmbedding)):
            m._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)
    return model


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QuantLinear) for m in model.modules())


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model holds (quantised buffers, fp parameters, tied storage counted once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def materialize(model: nn.Module) -> nn.Module:
    """Allocate (uninitialised, on CPU) whatever of a ``meta``-built model is still ``meta``, except quantised
    layers, and recompute the tables that are not in any state dict (rotary cos/sin)."""
    shared: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            shared.setdefault(id(p), []).append((m, name))
    for m in model.modules():
        if isinstance(m, Rotary):  # computed, not loaded: made on CPU directly
            m.cos, m.sin = m._table(m.cos.shape[0], "cpu")
        if not isinstance(m, QuantLinear):
            _empty_on_cpu(m)
    for owners in shared.values():  # to_empty per module gives each alias its own tensor: tie them again
        first = getattr(*owners[0])
        for m, name in owners[1:]:
            setattr(m, name, first)
    return model


def _empty_on_cpu(m: nn.Module) -> None:
    """``m.to_empty(device="cpu", recurse=False)`` by plain ``torch.empty``: ``to_empty`` runs torch's Python
    ``empty_like`` reference for ``meta`` tensors, which imports sympy (about 30 MiB of RSS, for good)."""
    for name, t in list(m._parameters.items()):
        if t is not None and t.is_meta:
            m._parameters[name] = nn.Parameter(torch.empty(t.shape, dtype=t.dtype), t.requires_grad)
    for name, t in list(m._buffers.items()):
        if t is not None and t.is_meta:
            m._buffers[name] = torch.empty(t.shape, dtype=t.dtype)


def tied_aliases(model: nn.Module) -> set[str]:
    """State-dict names that repeat another parameter (a tied head): a file holds only one of them."""
    seen, aliases = set(), set()
    for name, p in model.named_parameters(remove_duplicate=False):
        (aliases if id(p) in seen else seen).add(name if id(p) in seen else id(p))
    return aliases


class _NoMetaInit(TorchFunctionMode):
    """Skips the weight initialisers on ``meta`` tensors (they have no values to fill). Torch's meta kernel of
    ``normal_`` is Python and imports ``torch._dynamo`` and sympy on first use: about 65 MiB of RSS that a
    quantised load would otherwise keep for the life of the process."""

    _INIT = frozenset({"normal_", "uniform_", "trunc_normal_", "zero_", "zeros_", "ones_", "fill_", "constant_",
                       "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else kwargs.get("tensor", kwargs.get("self"))  # nn.init passes ``tensor=``
        if getattr(func, "__name__", None) in self._INIT and isinstance(first, torch.Tensor) and first.is_meta:
            return first
        return func(*args, **kwargs)


def build_meta(build, cfg) -> nn.Module:
    with torch.device("meta"), _NoMetaInit():
        return build(cfg)

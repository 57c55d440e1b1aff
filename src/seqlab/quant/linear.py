"""``QuantLinear`` and ``QuantEmbedding``: a linear layer (and a token table) whose weight is stored int4/int8.

The layer holds only the quantised buffers (``qweight``, ``scales``, ``mins`` for int4) and an optional fp32
bias; its state dict is those buffers, so a quantised model saves and loads with safetensors as it is. The
product is whichever route :mod:`seqlab.quant.routes` measured fastest for the shape. Inference only: there is
no gradient through an integer weight, and asking for one is an error rather than a silent zero.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqlab.quant.routes import run_route
from seqlab.quant.schemes import Scheme, dequantize_weight, quantize_weight


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, scheme: Scheme, bias: bool = False,
                 name: str = "layer"):
        super().__init__()
        scheme.check(in_features, name)
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = scheme.bits, scheme.group_size
        ng = scheme.groups(in_features)
        if scheme.bits == 4:
            self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
            self.register_buffer("mins", torch.zeros(out_features, ng))
        else:
            self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
            self.mins = None
        self.register_buffer("scales", torch.zeros(out_features, ng))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.prepared: dict[int, tuple] = {}  # row count -> the chosen route's product (seqlab.quant.routes)

    @property
    def scheme(self) -> Scheme:
        return Scheme(self.bits, self.group_size)

    @classmethod
    def from_parts(cls, parts: dict[str, Tensor], scheme: Scheme, bias: Tensor | None = None,
                   name: str = "layer") -> QuantLinear:
        """Wrap already-quantised tensors (``qweight``, ``scales`` [, ``mins``]) without copying them."""
        n = parts["qweight"].shape[0]
        k = parts["qweight"].shape[1] * (2 if scheme.bits == 4 else 1)
        layer = cls(k, n, scheme, bias is not None, name)
        layer.qweight, layer.scales = parts["qweight"].contiguous(), parts["scales"].float().contiguous()
        if scheme.bits == 4:
            layer.mins = parts["mins"].float().contiguous()
        if bias is not None:
            layer.bias = bias.detach().float().contiguous()
        return layer

    @classmethod
    def from_weight(cls, weight: Tensor, scheme: Scheme, bias: Tensor | None = None,
                    name: str = "layer") -> QuantLinear:
        scheme.check(weight.shape[1], name)
        return cls.from_parts(quantize_weight(weight, scheme, name), scheme, bias, name)

    def dequantize(self, rows: slice | None = None) -> Tensor:
        return dequantize_weight(self.qweight, self.scales, self.mins, self.bits, self.group_size, rows)

    @property
    def weight(self) -> Tensor:
        """The dense fp32 weight this layer stands for (a fresh copy: for inspection, not for speed)."""
        return self.dequantize()

    def forward(self, x: Tensor) -> Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("quantised layers (seqlab.quant) are for inference; gradients cannot flow through "
                               "an integer weight. Train the dense model.")
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous() or x2.device.type != "cpu":
            if x2.device.type != "cpu":
                return F.linear(x, self.dequantize().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
            x2 = x2.float().contiguous()
        y = run_route(self, x2)
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def _apply(self, fn, recurse: bool = True) -> QuantLinear:
        """Moves apply, dtype casts do not: ``model.to(torch.bfloat16)`` must leave the scales, minima and bias at
        the fp32 values the file (or the quantiser) gave, which the kernels read; rounded to bf16 they were other
        weights, and read as fp32 bytes, garbage. The layer has buffers only."""
        for key, buf in self._buffers.items():
            if buf is not None:
                moved = fn(buf)
                self._buffers[key] = moved if moved.dtype == buf.dtype else buf.to(moved.device)
        return self

    def extra_repr(self) -> str:
        g = self.group_size or "row"
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}, group={g}"


class QuantEmbedding(nn.Module):
    """Token lookups read from a :class:`QuantLinear`'s rows: a tied table stays stored once, quantised.

    The source layer is held outside the module tree (it is the LM head, already saved there), so the state
    dict holds the tied weight once and a quantised checkpoint has nothing to de-duplicate.
    """

    def __init__(self, source: QuantLinear, padding_idx: int | None = None):
        super().__init__()
        self._source = (source,)  # a tuple: not registered as a submodule
        self.num_embeddings, self.embedding_dim = source.out_features, source.in_features
        self.padding_idx = padding_idx

    @property
    def source(self) -> QuantLinear:
        return self._source[0]

    @property
    def weight(self) -> Tensor:
        return self.source.dequantize()

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1)
        uniq, inverse = torch.unique(flat, return_inverse=True)
        s = self.source
        q = s.qweight.index_select(0, uniq)
        mins = None if s.mins is None else s.mins.index_select(0, uniq)
        rows = dequantize_weight(q, s.scales.index_select(0, uniq), mins, s.bits, s.group_size)
        return rows.index_select(0, inverse).view(*ids.shape, self.embedding_dim)

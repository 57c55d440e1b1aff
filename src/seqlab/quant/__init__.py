"""Weight-only quantised inference: int8 / int4 linear layers, GGUF blocks kept quantised, measured routes.

    from seqlab.quant import quantize
    model = quantize(model, bits=4, group_size=64)

See ``docs/quantization.md`` for the schemes, their quality and their speed.
"""
from seqlab.quant import kernels, routes
from seqlab.quant.convert import apply_layout, is_quantized, quantize, quantized_bytes
from seqlab.quant.linear import QuantEmbedding, QuantLinear
from seqlab.quant.schemes import Scheme, dequantize_weight, quantize_weight

__all__ = ["QuantEmbedding", "QuantLinear", "Scheme", "apply_layout", "dequantize_weight", "is_quantized",
           "quantize", "quantize_weight", "quantized_bytes"]

"""Generation: prefill/decode on the KV cache; greedy, sampling, beam search, speculative decoding; streaming.

The stable entry point is :func:`generate` (Hugging Face layout in, Hugging Face layout out); the richer API is
:func:`generate_output` (sequences + metrics), :func:`stream` (an iterator of new tokens / text pieces) and
:class:`GenerationConfig`. ``prefill`` and ``decode_step`` are the two model calls everything is built on.
"""
from seqlab.generate.api import GenerationOutput, generate, generate_output, stream
from seqlab.generate.config import GenerationConfig
from seqlab.generate.engine import decode_step, prefill
from seqlab.generate.metrics import GenerationMetrics
from seqlab.generate.sampling import LogitsProcessor, SamplingParams
from seqlab.generate.text import Stream, StreamChunk

__all__ = [
    "GenerationConfig",
    "GenerationMetrics",
    "GenerationOutput",
    "LogitsProcessor",
    "SamplingParams",
    "Stream",
    "StreamChunk",
    "decode_step",
    "generate",
    "generate_output",
    "prefill",
    "stream",
]

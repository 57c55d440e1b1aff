"""The Transformer core: config-driven blocks, masks built in one place, a static KV cache."""

from seqlab.model.cache import CacheOverflowError, KVCache
from seqlab.model.transformer import Decoder, Encoder, EncoderDecoder, build_model

__all__ = ["CacheOverflowError", "Decoder", "Encoder", "EncoderDecoder", "KVCache", "build_model"]

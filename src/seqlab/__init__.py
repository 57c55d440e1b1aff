"""seqlab: one autoregressive Transformer core that learns, generates, and solves molecules."""

__version__ = "0.1.0"

from seqlab.config import ConfigError, ModelConfig  # noqa: E402
from seqlab.model import build_model  # noqa: E402

__all__ = ["ConfigError", "ModelConfig", "__version__", "build_model"]

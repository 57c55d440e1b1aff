"""Edges of seqlab: its own checkpoints, Hugging Face folders, GGUF files and chat templates."""

from seqlab.io.checkpoint import CheckpointError, load_pretrained, save_pretrained
from seqlab.io.hf import convert_hf_state_dict, load_hf

__all__ = ["CheckpointError", "convert_hf_state_dict", "load_hf", "load_pretrained", "save_pretrained"]
from seqlab.io.gguf import GGUFError, load_gguf  # noqa: E402  (GGUF import; the `gguf` package is needed only when called)

__all__ += ["GGUFError", "load_gguf"]

"""Edges of seqlab: its own checkpoints, Hugging Face folders and GGUF files (the `gguf` package is needed only
when a GGUF file is read)."""

from seqlab.io.checkpoint import CheckpointError, load_pretrained, resolve_checkpoint, save_pretrained
from seqlab.io.gguf import GGUFError, load_gguf
from seqlab.io.hf import convert_hf_state_dict, load_hf

__all__ = ["CheckpointError", "GGUFError", "convert_hf_state_dict", "load_gguf", "load_hf", "load_pretrained",
           "resolve_checkpoint", "save_pretrained"]

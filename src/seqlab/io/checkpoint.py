"""seqlab's own model format (``config.json`` + ``model.safetensors``), and where a checkpoint path leads.

Every command that accepts a checkpoint (generate, chat, info, ``load_pretrained``) resolves it with
:func:`resolve_checkpoint`: a model folder is itself, a training checkpoint (``step_*/``) is itself, and a run
directory is its latest checkpoint. A training checkpoint carries the sha256 of each file in ``state.json``; those
are verified before anything is loaded, so a bit-rotted file is refused instead of generating garbage.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

import seqlab
from seqlab.config import ModelConfig
from seqlab.io.gguf_file import refuse_gguf_file
from seqlab.io.hf import load_hf
from seqlab.io.tensors import load_state_into, load_tensors, read_config_json, save_tensors, unique_state_dict
from seqlab.model import build_model
from seqlab.quant.checkpoint import load_quantized, save_quantized
from seqlab.quant.convert import cast_unquantised, is_quantized
from seqlab.runtime import CheckpointError, atomic_write_text
from seqlab.train.checkpoint import load_checkpoint, resolve_checkpoint

FORMAT = "seqlab"

__all__ = ["CheckpointError", "FORMAT", "load_pretrained", "load_state_into", "model_config_from_doc",
           "resolve_checkpoint", "save_pretrained"]


def save_pretrained(model: nn.Module, out_dir: str | os.PathLike) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (atomically) to ``out_dir``; a quantised model in the
    quantised format (:func:`seqlab.quant.save_quantized`), which ``load_pretrained`` reads back."""
    if is_quantized(model):
        return save_quantized(model, out_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_tensors(unique_state_dict(model), out / "model.safetensors", metadata={"format": "pt"})
    doc = {"format": FORMAT, "seqlab_version": seqlab.__version__, "config": model.config.to_dict()}
    atomic_write_text(out / "config.json", json.dumps(doc, indent=2) + "\n")
    return out


def model_config_from_doc(doc: dict, source: Path) -> ModelConfig:
    """The ModelConfig of a seqlab ``config.json`` document; a malformed one names the file and the field."""
    if not isinstance(doc.get("config"), dict):
        raise CheckpointError(f"{source}: no \"config\" object (a seqlab config.json has format + config)")
    try:
        return ModelConfig.from_dict(doc["config"])
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{source}: {e}") from None


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype | None = None, device=None) -> nn.Module:
    """Load a seqlab model folder, training checkpoint or run directory (latest checkpoint), verified; a Hugging
    Face folder is handed to ``load_hf``."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}")
    refuse_gguf_file(path)
    folder = resolve_checkpoint(path)
    tensors = None
    if (folder / "state.json").is_file():  # a training checkpoint: every file is checked against its sha256 first
        _, tensors, _ = load_checkpoint(folder, load_optimizer=False)
    doc = read_config_json(folder / "config.json")
    if doc.get("format") != FORMAT:
        if "model_type" not in doc:
            raise CheckpointError(f"{folder / 'config.json'}: neither a seqlab config (\"format\": \"seqlab\") nor a "
                                  "Hugging Face one (\"model_type\")")
        return load_hf(folder, dtype=dtype, device=device)
    if "quant" in doc:  # written by seqlab.quant (int4 / int8 buffers, checked against their digest)
        return cast_unquantised(load_quantized(folder, doc).to(device=device), dtype)
    model = build_model(model_config_from_doc(doc, folder / "config.json"))
    if tensors is None:
        tensors = load_tensors(folder / "model.safetensors")
    load_state_into(model, tensors, str(folder / "model.safetensors"))
    return model.to(device=device, dtype=dtype).eval()
